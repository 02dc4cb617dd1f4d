"""GPU check of the vLLM engine behind the gateway (one script, under 5 minutes on one GPU).

Starts the gateway with the vllm engine on the built-in SmolLM2-135M-Instruct, then checks, each step printed
with its figures (exit status 1 if one fails): a stream stays on its adapter version while newer versions are
published (its logprobs match its own version's teacher-forced scores); throughput at 1 and 32 streams; and
logprob parity of vLLM against a transformers fp32 reference within ``--tol-mean`` / ``--tol-max`` nats; and a
trainer group (``bench/train.py --nproc N``, nccl, one GPU per rank, ``--group-ranks``) against one process. The
steps and tolerances: ``docs/internals/bench.md``; the group: ``docs/scaling-out.md``.

Usage on a GPU box (needs vllm, and the store holding the converted model)::

    python bench/gpu_check.py                       # cuda, bf16, streams 1,32
    .venv-vllm/bin/python bench/gpu_check.py --device cpu --dtype float32 \\
        --streams 1,4 --tokens 16 --long-tokens 64 --max-model-len 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a long story about a dragon who learns to bake bread."
SHORT_PROMPTS = [
    "Explain photosynthesis.",
    "What is the capital of France?",
    "List some fruits.",
    "Describe the sea.",
    "How do planes fly?",
    "Tell me a joke.",
    "What is Python?",
    "Write a haiku about rain.",
]

results: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str) -> bool:
    results.append((name, ok, detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
    return ok


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_adapters(base_ref, root: Path, count: int) -> list[Path]:
    """``count`` rank-16 LoRA versions on all linear layers, different random lora_B (peft format)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from livelora.core.base_models import load_model

    model = get_peft_model(
        load_model(base_ref),
        LoraConfig(
            r=16,
            lora_alpha=32,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    out = []
    for k in range(1, count + 1):
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        model.save_pretrained(root / f"v{k}")
        out.append(root / f"v{k}")
    return out


def bytes_to_id(tokenizer) -> dict[bytes, int]:
    """Token bytes -> token id (the chat logprobs carry each token's bytes, not its id)."""
    from livelora.gateway.api.logprobs import TokenTexts

    texts, table = TokenTexts(tokenizer), {}
    for tid in range(len(tokenizer)):
        table.setdefault(bytes(texts.get(tid)[1]), tid)
    return table


async def sse_chat(client, body: dict, on_chunk=None) -> dict:
    """Stream one chat completion; returns {chunks, fingerprints, header, logprobs, text, times}."""
    got = {"chunks": 0, "fingerprints": set(), "logprobs": [], "text": "", "times": []}
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        got["header"] = r.headers.get("x-livelora-adapter-version")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices"):
                continue
            got["chunks"] += 1
            got["times"].append(time.perf_counter())
            got["fingerprints"].add(chunk.get("system_fingerprint"))
            choice = chunk["choices"][0]
            got["text"] += choice["delta"].get("content") or ""
            got["logprobs"].extend((choice.get("logprobs") or {}).get("content") or [])
            if on_chunk is not None:
                on_chunk()
    return got


async def throughput(client, model: str, tokenizer, streams: int, n_tokens: int) -> tuple[float, int]:
    """tokens/s over ``streams`` concurrent non-streaming requests of ``n_tokens`` each (EOS ignored)."""

    async def one(i: int) -> int:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": SHORT_PROMPTS[i % len(SHORT_PROMPTS)]}],
                "max_tokens": n_tokens,
                "temperature": 1.0,
                "seed": i,
                "ignore_eos": True,
            },
        )
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    counts = await asyncio.gather(*[one(i) for i in range(streams)])
    return sum(counts) / (time.perf_counter() - started), sum(counts)


async def main(args) -> int:
    import httpx
    import uvicorn

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # vLLM takes this share of GPU memory; the rest is for the fp32 reference at the end.
    os.environ.setdefault("LIVELORA_VLLM_GPU_MEMORY_UTILIZATION", str(args.gpu_memory_utilization))
    from livelora.core.base_models import load_tokenizer, resolve_base_model
    from livelora.core.settings import CommonSettings
    from livelora.gateway.api.deps import services_of
    from livelora.gateway.app import create_app
    from livelora.gateway.engines import create_engine
    from livelora.gateway.settings import GatewaySettings

    t_all = time.perf_counter()
    base = CommonSettings()
    ref = resolve_base_model(base.model, base.home)
    tokenizer = load_tokenizer(ref)
    tmp = Path(tempfile.mkdtemp(prefix="livelora-gpu-check-"))
    v1, v2, v3 = make_adapters(ref, tmp, 3)
    streams = [int(s) for s in args.streams.split(",")]
    port = free_port()
    settings = GatewaySettings(
        engine="vllm",
        device=args.device,
        dtype=args.dtype,
        host="127.0.0.1",
        port=port,
        max_batch_size=max(64, max(streams)),
        max_waiting=256,
        max_model_len=args.max_model_len,
    )
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t0 = time.perf_counter()
    serving = asyncio.create_task(server.serve())
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        while True:
            if serving.done():
                serving.result()
                raise RuntimeError("the gateway stopped during start-up")
            try:
                if (await client.get("/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.5)
        engine = services_of(app).engine
        print(
            f"gateway up with vLLM {engine.vllm_version} on {args.device} ({engine.config.dtype}) in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )

        # ----- 2. a long stream on check@1 while check@2 and check@3 are published ----------------------
        await engine.load_adapter("check@1", str(v1))
        first_chunk, after_publish = asyncio.Event(), {"n": 0, "published": False}

        def on_chunk():
            first_chunk.set()
            if after_publish["published"]:
                after_publish["n"] += 1

        body = {
            "model": "check@1",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": args.long_tokens,
            "temperature": 0,
            "logprobs": True,
            "ignore_eos": True,
        }
        long_stream = asyncio.create_task(sse_chat(client, body, on_chunk))
        await asyncio.wait_for(first_chunk.wait(), 300)
        t_pub = time.perf_counter()
        await engine.load_adapter("check@2", str(v2))
        await engine.load_adapter("check@3", str(v3))
        t_pub = time.perf_counter() - t_pub
        after_publish["published"] = True
        during = await client.post(
            "/v1/chat/completions",
            json={
                "model": "check@3",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "temperature": 0,
            },
        )
        still_running = not long_stream.done()
        got = await long_stream
        print(
            f"published check@2 + check@3 in {t_pub:.2f} s while the stream ran; "
            f"{after_publish['n']} of {got['chunks']} chunks arrived after the publishes",
            flush=True,
        )
        check(
            "stream ran across the publishes",
            still_running and after_publish["n"] > 0,
            f"{after_publish['n']} chunks after publishing; check@3 answered HTTP {during.status_code} meanwhile",
        )
        check(
            "stream labelled with its version",
            got["fingerprints"] == {"livelora-check@1"} and got["header"] == "check@1",
            f"fingerprints {got['fingerprints']}, header {got['header']}",
        )
        table = bytes_to_id(tokenizer)
        ids = [table.get(bytes(e["bytes"])) for e in got["logprobs"]]
        streamed = [e["logprob"] for e in got["logprobs"]]
        if None in ids or not ids:
            check("stream tokens recovered", False, f"{ids.count(None)} tokens not mapped back to ids")
        else:
            prompt_ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
            prompt_ids = list(prompt_ids["input_ids"] if not isinstance(prompt_ids, list) else prompt_ids)
            full = prompt_ids + ids
            s1 = [x.logprob for x in (await engine.score(full, adapter="check@1"))[len(prompt_ids) :]]
            s3 = [x.logprob for x in (await engine.score(full, adapter="check@3"))[len(prompt_ids) :]]
            d1 = statistics.fmean(abs(a - b) for a, b in zip(streamed, s1))
            d3 = statistics.fmean(abs(a - b) for a, b in zip(streamed, s3))
            check(
                "stream stayed on check@1",
                d1 <= args.tol_same and d3 > 5 * max(d1, 1e-3),
                f"{len(ids)} tokens; mean |streamed - score(check@1)| = {d1:.5f} nats (tol {args.tol_same}), "
                f"vs score(check@3) = {d3:.4f}",
            )
        await engine.unload_adapter("check@1")
        cached = await engine.vllm_loaded_ids()
        check(
            "check@1 unloaded after drain",
            "check@1" not in engine.loaded_adapters() and engine.lora_int_id("check@2") in cached and len(cached) == 2,
            f"loaded {engine.loaded_adapters()}, vLLM adapter ids {sorted(cached)}",
        )

        # ----- 4. throughput ------------------------------------------------------------------------------
        await throughput(client, "check@2", tokenizer, 1, 4)  # warm-up
        for n in streams:
            tps, total = await throughput(client, "check@2", tokenizer, n, args.tokens)
            print(
                f"throughput, adapter check@2, {n:3d} concurrent streams x {args.tokens} tokens: "
                f"{tps:8.1f} tokens/s ({total} tokens)",
                flush=True,
            )

        # ----- 5. parity material: vLLM's scores of one prompt + completion under check@2 -----------------
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": "check@2",
                "messages": [{"role": "user", "content": SHORT_PROMPTS[0]}],
                "max_tokens": 48,
                "temperature": 1.0,
                "seed": 3,
                "logprobs": True,
            },
        )
        r.raise_for_status()
        content = r.json()["choices"][0]["logprobs"]["content"]
        comp = [table.get(bytes(e["bytes"])) for e in content]
        p_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": SHORT_PROMPTS[0]}], add_generation_prompt=True
        )
        p_ids = list(p_ids["input_ids"] if not isinstance(p_ids, list) else p_ids)
        parity_ids = p_ids + [t for t in comp if t is not None]
        vllm_scores = [x.logprob for x in (await engine.score(parity_ids, adapter="check@2"))[1:]]
    server.should_exit = True
    await serving  # lifespan closes the vLLM engine (its GPU memory is released)

    reference = create_engine("transformers", device=args.device, dtype="float32", max_batch_size=4)
    await reference.start()
    await reference.load_adapter("check@2", str(v2))
    hf_scores = [x.logprob for x in (await reference.score(parity_ids, adapter="check@2"))[1:]]
    await reference.close()
    diffs = [abs(a - b) for a, b in zip(vllm_scores, hf_scores)]
    mean_d, max_d = statistics.fmean(diffs), max(diffs)
    check(
        "vLLM vs transformers logprobs (same prompt + check@2)",
        mean_d <= args.tol_mean and max_d <= args.tol_max,
        f"{len(diffs)} positions: mean |Δ| {mean_d:.5f} (tol {args.tol_mean}), max |Δ| {max_d:.5f} "
        f"(tol {args.tol_max}); vLLM {args.dtype or 'default dtype'} vs transformers float32",
    )

    if args.group_ranks:  # a trainer group on nccl (docs/scaling-out.md): bench/train.py --nproc N, one GPU per rank
        cmd = [sys.executable, str(Path(__file__).with_name("train.py")), "--skip-trl", "--steps", "2"]
        for extra in ([], ["--shard-base"]):  # then the base weights sharded over the ranks (FSDP2)
            run = subprocess.run(
                [*cmd, "--batch", "8", "--seq-len", "128", f"--nproc={args.group_ranks}", *extra],
                text=True,
                capture_output=True,
            )
            print(run.stdout[-2000:], run.stderr[-2000:] if run.returncode else "", flush=True)
            check(
                f"trainer group of {args.group_ranks} (nccl{', base sharded' if extra else ''}) vs one process",
                run.returncode == 0,
                f"bench/train.py --nproc {args.group_ranks} {' '.join(extra)}: exit status {run.returncode}",
            )

    print(
        f"total {time.perf_counter() - t_all:.1f} s; {sum(ok for _, ok, _ in results)}/{len(results)} checks passed",
        flush=True,
    )
    return 0 if all(ok for _, ok, _ in results) else 1


async def run_check(args) -> int:
    """:func:`main`, then remove the adapters it wrote (``livelora-gpu-check-*`` in the temp dir)."""
    import shutil

    before = set(Path(tempfile.gettempdir()).glob("livelora-gpu-check-*"))
    try:
        return await main(args)
    finally:
        for d in set(Path(tempfile.gettempdir()).glob("livelora-gpu-check-*")) - before:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":  # vLLM spawns its engine process: the engine must be created under this guard
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="vLLM dtype (default bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--streams", default="1,32", help="concurrent streams for the throughput figures")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per throughput request")
    parser.add_argument("--long-tokens", type=int, default=400, help="tokens of the long stream")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument(
        "--tol-same",
        type=float,
        default=0.02,
        help="mean |Δ| streamed vs teacher-forced logprobs, same engine and adapter (nats)",
    )
    parser.add_argument("--tol-mean", type=float, default=0.05, help="vLLM vs transformers, mean |Δ| (nats)")
    parser.add_argument("--tol-max", type=float, default=0.5, help="vLLM vs transformers, max |Δ| (nats)")
    parser.add_argument(
        "--group-ranks", type=int, default=1, help="ranks (GPUs) of the trainer-group check on nccl; 0 skips it"
    )
    sys.exit(asyncio.run(run_check(parser.parse_args())))
