"""Aggregate decode throughput of the transformers engine vs plain ``model.generate``.

Prints tokens/s (new tokens over wall time) for:

* ``generate`` sequential: one ``model.generate`` call per request, batch 1;
* ``generate`` batch N: one padded ``model.generate`` call for N requests;
* engine, 1 stream and N concurrent streams (continuous batching);
* engine, N streams where a third use one of two LoRA adapters (mixed batch).

Every run samples (temperature 1, fixed seeds) ``--tokens`` new tokens per
request with EOS ignored, so all runs produce the same number of tokens.
The machine may be shared: read the figures side by side, not absolutely.

Usage: ``python bench/engine_throughput.py [--streams 8] [--tokens 64] [--device cpu]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

import torch

PROMPTS = [
    "Write a story about a dragon.",
    "Explain photosynthesis.",
    "What is the capital of France?",
    "List some fruits.",
    "Describe the sea.",
    "How do planes fly?",
    "Tell me a joke.",
    "What is Python?",
]


def chat_ids(tok, text):
    enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


def bench_generate(model, tok, prompts, n_tokens, batch):
    """tokens/s of model.generate over ``prompts`` in batches of ``batch`` (left padding)."""
    tok.padding_side = "left"
    total, started = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        enc = tok.pad({"input_ids": group}, return_tensors="pt")
        torch.manual_seed(i)
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=n_tokens,
                min_new_tokens=n_tokens,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                pad_token_id=tok.pad_token_id,
            )
        total += (out.shape[1] - enc["input_ids"].shape[1]) * len(group)
    return total / (time.perf_counter() - started)


async def bench_engine(engine, prompts, n_tokens, adapters=None):
    from livelora.gateway.engines import SamplingParams

    async def one(i, p):
        n = 0
        params = SamplingParams(max_tokens=n_tokens, temperature=1.0, seed=i, ignore_eos=True)
        async for chunk in engine.generate(p, params, adapter=adapters[i] if adapters else None):
            n += len(chunk.token_ids)
        return n

    started = time.perf_counter()
    counts = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    return sum(counts) / (time.perf_counter() - started)


def make_adapter(model, out_dir, seed):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    peft_model.save_pretrained(out_dir)
    peft_model.unload()


async def main(args):
    from livelora.core.base_models import load_model, load_tokenizer, resolve_base_model
    from livelora.core.settings import CommonSettings
    from livelora.gateway.engines import create_engine

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = CommonSettings()
    ref = resolve_base_model(settings.model, settings.home)
    tok = load_tokenizer(ref)
    model = load_model(ref, device=args.device)
    prompts = [chat_ids(tok, PROMPTS[i % len(PROMPTS)]) for i in range(args.streams)]
    print(
        f"torch threads {torch.get_num_threads()}, {args.tokens} new tokens per request, "
        f"{args.streams} requests, device {args.device}"
    )
    bench_generate(model, tok, prompts[:1], 4, 1)  # warm-up
    seq = bench_generate(model, tok, prompts[: args.sequential_requests], args.tokens, 1)
    print(f"model.generate sequential (batch 1): {seq:7.1f} tok/s  ({args.sequential_requests} requests)")
    batched = bench_generate(model, tok, prompts, args.tokens, args.streams)
    print(f"model.generate batch {args.streams}:            {batched:7.1f} tok/s")

    engine = create_engine("transformers", device=args.device, max_batch_size=max(16, args.streams))
    await engine.start()
    await bench_engine(engine, prompts[:1], 4)  # warm-up
    one = await bench_engine(engine, prompts[:1], args.tokens)
    print(f"engine 1 stream:                     {one:7.1f} tok/s")
    many = await bench_engine(engine, prompts, args.tokens)
    print(
        f"engine {args.streams} concurrent streams:        {many:7.1f} tok/s  ({many / seq:.1f}x sequential generate)"
    )
    if not args.skip_adapters:
        with tempfile.TemporaryDirectory() as tmp:
            names = []
            for k in range(2):
                make_adapter(model, os.path.join(tmp, f"a{k}"), seed=k)
                await engine.load_adapter(f"bench@{k}", os.path.join(tmp, f"a{k}"))
                names.append(f"bench@{k}")
            choice = [names[i % 3] if i % 3 < 2 else None for i in range(args.streams)]
            mixed = await bench_engine(engine, prompts, args.tokens, adapters=choice)
            print(f"engine {args.streams} streams, 2 adapters + base: {mixed:7.1f} tok/s")
            for name in names:
                await engine.unload_adapter(name)
            base_again = await bench_engine(engine, prompts, args.tokens)
            print(f"engine {args.streams} streams after unload:     {base_again:7.1f} tok/s")
    await engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--sequential-requests", type=int, default=2, help="requests timed for the sequential batch-1 baseline"
    )
    parser.add_argument("--skip-adapters", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    asyncio.run(main(parser.parse_args()))
