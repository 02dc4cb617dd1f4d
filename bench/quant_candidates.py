"""Served weight formats side by side: decode tok/s at batch 1 and 8, and fidelity against fp32.

The model is SmolLM2-135M-Instruct with a rank-16 LoRA on every linear layer merged into its weights
(``W + s·B A``, B drawn at scale 0.05), as the engine serves a version every row uses. Candidates: ``fp32``,
``bf16`` (the whole model), ``int8`` (weight-only, ``gateway/engines/quantized.py``), ``int4`` (the base in int4
with ``lm_head`` in bfloat16 and the same LoRA unmerged, as the engine serves it; ``int4-head-fp32`` and
``int4-head-int4`` vary ``lm_head``) and ``int8-dynamic`` (``torch.ao`` dynamic quantization, per-channel int8
weights and per-batch int8 activations). Speed: tok/s of
one decode step (median of ``--steps`` after prefilling 1 or 8 prompts), candidates alternating over ``--rounds``
rounds, median reported; on a shared machine run it with ``OMP_NUM_THREADS=1`` (docs/serving.md). Fidelity:
mean per-token KL(p_fp32 ‖ p_candidate) over fp32's greedy continuations of the prompts (teacher-forced), and
the share of prompts whose greedy reply equals fp32's.

    OMP_NUM_THREADS=1 python bench/quant_candidates.py --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings

import torch
from serve import PROMPTS  # the same prompts as bench/serve.py (this script's folder is on sys.path)

from livelora.core.base_models import load_model, load_tokenizer, resolve_base_model
from livelora.core.settings import CommonSettings
from livelora.gateway.engines.quantized import quantize_linears


def merged_model(rank: int, seed: int, base_weights: str | None = None, head: str | None = None):
    """The fp32 base with a seeded rank-``rank`` LoRA on every linear layer merged in; with ``base_weights``
    (``int4``) the base layers serve that format and the LoRA stays unmerged beside them in float32, as the
    engine serves ``int4`` (``head``: a format for ``lm_head`` alone, quantized first)."""
    from peft import LoraConfig, get_peft_model

    settings = CommonSettings()
    model = load_model(resolve_base_model(settings.model, settings.home))
    if head and head != "fp32":
        quantize_linears(model.lm_head, head)
    if base_weights:
        quantize_linears(model, base_weights, skip=(model.lm_head,) if head == "fp32" else ())
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
    torch.manual_seed(seed)  # lora_A's initialisation: the same factors in every candidate
    peft = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return (peft if base_weights else peft.merge_and_unload()).eval()


def candidates(ref, rank: int) -> dict:
    """Name → model serving the candidate format (copies of ``ref``; ``int4`` rebuilt from the base, the same
    seeded LoRA unmerged)."""
    out = {"fp32": ref, "bf16": copy.deepcopy(ref).to(torch.bfloat16)}
    int8 = copy.deepcopy(ref)
    quantize_linears(int8)
    out["int8"] = int8
    out["int4"] = merged_model(rank, seed=0, base_weights="int4", head="bf16")  # as the engine serves it
    out["int4-head-fp32"] = merged_model(rank, seed=0, base_weights="int4", head="fp32")
    out["int4-head-int4"] = merged_model(rank, seed=0, base_weights="int4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        out["int8-dynamic"] = quantize_dynamic(copy.deepcopy(ref), {torch.nn.Linear: per_channel_dynamic_qconfig})
    return out


def encode(tok, prompts: list[str]) -> dict:
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    tok.padding_side = "left"
    return tok(texts, return_tensors="pt", padding=True)


def greedy(model, batch: dict, tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[:, batch["input_ids"].shape[1] :]


def tok_per_s(model, batch: dict, steps: int) -> float:
    """Rows / median seconds of one decode step (after the prefill of ``batch``)."""
    from transformers import DynamicCache

    ids, mask = batch["input_ids"], batch["attention_mask"]
    rows, times = ids.shape[0], []
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype)], 1)
            t0 = time.perf_counter()
            out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
    return rows / statistics.median(times)


def fidelity(ref, model, tok, tokens: int) -> tuple[float, float]:
    """(mean per-token KL(fp32 ‖ model) on fp32's greedy replies, share of prompts with equal greedy replies)."""
    kls, same = [], 0
    for prompt in PROMPTS:
        batch = encode(tok, [prompt])
        ref_reply = greedy(ref, batch, tokens)
        same += int(torch.equal(ref_reply, greedy(model, batch, tokens)))
        ids = torch.cat([batch["input_ids"], ref_reply], 1)
        with torch.inference_mode():
            lp_ref = torch.log_softmax(ref(ids).logits[0, -tokens - 1 : -1].float(), -1)
            lp = torch.log_softmax(model(ids).logits[0, -tokens - 1 : -1].float(), -1)
        kls.append((lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item())
    return statistics.mean(kls), same / len(PROMPTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per reply for the fidelity figures")
    parser.add_argument("--steps", type=int, default=6, help="decode steps timed per candidate and batch size")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--only", nargs="*", help="candidate names (default: all)")
    args = parser.parse_args()
    print(f"load: {os.getloadavg()[0]:.2f}  threads: {torch.get_num_threads()}", flush=True)
    tok = load_tokenizer(resolve_base_model(CommonSettings().model, CommonSettings().home))
    ref = merged_model(args.rank, seed=0)
    models = {k: v for k, v in candidates(ref, args.rank).items() if not args.only or k in args.only or k == "fp32"}
    b1, b8 = encode(tok, PROMPTS[:1]), encode(tok, PROMPTS)
    speeds: dict[str, dict[int, list[float]]] = {k: {1: [], 8: []} for k in models}
    for r in range(args.rounds):
        for name, model in models.items():
            speeds[name][1].append(tok_per_s(model, b1, args.steps))
            speeds[name][8].append(tok_per_s(model, b8, args.steps))
        print(f"round {r + 1} done, load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"{'weights':14} {'b1 tok/s':>9} {'b8 tok/s':>9} {'KL/token':>10} {'greedy same':>12}")
    for name, model in models.items():
        kl, same = fidelity(ref, model, tok, args.tokens)
        s1, s8 = statistics.median(speeds[name][1]), statistics.median(speeds[name][8])
        print(f"{name:14} {s1:9.1f} {s8:9.1f} {kl:10.2e} {same:12.0%}", flush=True)
    print(f"load at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
