"""Serving many adapter versions at once: throughput and inter-token latency with 1, 4, 16 and 64 distinct
versions in flight, each against the same load on one version measured in the same run, on the transformers
(fp32) and llama.cpp (f16) engines; plus memory per loaded version.

Versions are random LoRAs of the live loop's shape (rank 8, alpha 32, attention and MLP projections; B drawn
from N(0, 0.02²) so every version answers differently), loaded with ``load_and_check`` and a canary as the live
loop loads them. Request ``i`` uses version ``i mod V``; greedy, ``ignore_eos``, ``--max-tokens`` tokens each,
``--streams`` in flight. Rounds alternate one version and V versions; every round is printed, then the medians
and their ratio. Method and figures: ``docs/serving.md`` (Serving many versions at once).

    python bench/many_versions.py                                  # both engines, 8 and 32 streams
    python bench/many_versions.py --engines transformers --streams 8 --versions 1,16 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import PROMPTS, odd_rounds, percentile  # the serving bench's prompts, quantile and rounds check


def rss_mb() -> float:
    """Resident set size of this process (MiB, from /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_versions(out: Path, count: int) -> list[Path]:
    """``count`` PEFT directories of the live loop's LoRA shape (trainer settings: rank, alpha, targets) with
    random ``B`` (seed = index)."""
    import torch

    from livelora.core.base_models import load_model, resolve_base_model
    from livelora.core.settings import CommonSettings
    from livelora.trainer.lora_peft import wrap_lora
    from livelora.trainer.settings import TrainingSection

    settings, training = CommonSettings(), TrainingSection()
    model = load_model(resolve_base_model(settings.model, settings.home), dtype="float32", device="cpu")
    peft_model, _ = wrap_lora(model, training.lora, alpha=training.lora_alpha, seed=0, base_name=settings.model)
    params = [(n, p) for n, p in peft_model.named_parameters() if "lora_B" in n]
    paths = []
    for k in range(count):
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for _, p in params:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        path = out / f"v{k}"
        peft_model.save_pretrained(str(path))
        paths.append(path)
    return paths


async def run_load(engine, prompts: list[list[int]], versions: list[str], streams: int, requests: int, tokens: int):
    """``requests`` greedy requests, ``streams`` in flight, request ``i`` on ``versions[i % len(versions)]``:
    ``{"tok_s", "itl_p50", "itl_p99"}`` (inter-token gaps in ms)."""
    from livelora.gateway.engines import SamplingParams

    queue = list(range(requests))
    gaps: list[float] = []
    total = 0

    async def worker() -> None:
        nonlocal total
        while queue:
            i = queue.pop(0)
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            last = None
            async for chunk in engine.generate(prompts[i % len(prompts)], params, adapter=versions[i % len(versions)]):
                now = time.perf_counter()
                if chunk.token_ids and last is not None:
                    gaps.append((now - last) * 1000)
                last = now
                total += len(chunk.token_ids)

    start = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(streams)])
    wall = time.perf_counter() - start
    return {"tok_s": total / wall, "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99)}


async def load_versions(engine, paths: list[Path], canary: list[int]) -> list[str]:
    """Load every path as ``bench@k`` with ``load_and_check`` (the live loop's way); prints the memory they take."""
    before = rss_mb()
    names = []
    t0 = time.perf_counter()
    for k, path in enumerate(paths):
        name = f"bench@{k}"
        await engine.load_and_check(name, str(path), canary)
        names.append(name)
    took = time.perf_counter() - t0
    grown = rss_mb() - before
    line = f"  loaded {len(names)} versions in {took:.1f} s; RSS +{grown:.0f} MiB ({grown / len(names):.2f} MiB each)"
    lora = lora_bytes(engine)
    if lora is not None:
        line += f"; LoRA tensors {lora / 2**20:.1f} MiB ({lora / 2**20 / len(names):.2f} MiB a version)"
    print(line, flush=True)
    return names


def lora_bytes(engine) -> int | None:
    """Bytes of the LoRA tensors in the transformers engine's slots (``None`` for llama.cpp)."""
    slots = getattr(engine._worker.backend, "slots", None)
    if slots is None or slots.peft is None:
        return None
    return sum(p.numel() * p.element_size() for n, p in slots.peft.named_parameters() if "lora_" in n)


def chat_ids(tok, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn in the chat template."""
    enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


def make_engine(kind: str, max_batch: int, threads: int):
    from livelora.gateway.engines import create_engine

    if kind == "transformers":
        return create_engine(
            "transformers", device="cpu", weights="fp32", max_batch_size=max_batch, num_threads=threads
        )
    return create_engine("llama_cpp", weights="f16", max_batch_size=max_batch, num_threads=threads)


async def bench_engine(kind: str, args, paths: list[Path]) -> list[str]:
    """Every (streams, versions) cell of one engine; returns the summary lines."""

    if args.stacked:  # the rank-stacked pass at any number of versions (what served them before the gathered one)
        from livelora.gateway.engines import lora_slots

        lora_slots.GATHER_FROM = 1 << 30
    engine = make_engine(kind, max(args.streams), args.threads)
    await engine.start()
    tok = engine.tokenizer
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    canary = prompts[0]
    print(f"{kind}: engine threads {args.threads}, load {os.getloadavg()[0]:.1f}", flush=True)
    names = await load_versions(engine, paths, canary)
    await run_load(engine, prompts, names[:2], 2, 2, 4)  # warm-up
    lines = []
    for streams in args.streams:
        requests = streams * args.requests_per_stream
        for v in args.versions:
            one: list[dict] = []
            many = one if v == 1 else []
            for r in range(args.rounds):
                loads = (("1 version", names[:1], one),) + (((f"{v} versions", names[:v], many),) if v > 1 else ())
                for label, pool, out in loads:
                    res = await run_load(engine, prompts, pool, streams, requests, args.max_tokens)
                    out.append(res)
                    print(
                        f"  round {r + 1} {streams:2} streams {label:12}: {res['tok_s']:6.1f} tok/s, inter-token "
                        f"p50 {res['itl_p50']:.0f} ms p99 {res['itl_p99']:.0f} ms (load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
            med = {k: statistics.median(x[k] for x in many) for k in many[0]}
            base = {k: statistics.median(x[k] for x in one) for k in one[0]}
            lines.append(
                f"| {kind} | {streams} | {v} | {med['tok_s']:.1f} | {base['tok_s']:.1f} | "
                f"{med['tok_s'] / base['tok_s']:.2f} | {med['itl_p50']:.0f} / {med['itl_p99']:.0f} | "
                f"{base['itl_p50']:.0f} / {base['itl_p99']:.0f} |"
            )
            print(lines[-1], flush=True)
    stats = getattr(engine._worker, "residency", None)
    if stats is not None:
        print(f"  version loads {stats.loads}, evictions {stats.evictions}", flush=True)
    await engine.close()
    return lines


async def main(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_versions(Path(tmp), max(args.versions))
        print(
            f"{len(paths)} versions, {args.max_tokens} tokens a request, {args.requests_per_stream} requests a "
            f"stream, {args.rounds} rounds, load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d')}",
            flush=True,
        )
        lines = []
        for kind in args.engines:
            lines += await bench_engine(kind, args, paths)
    print(
        f"\nmedian of {args.rounds} rounds\n| engine | streams | versions | tok/s | tok/s 1 version | ratio | "
        "inter-token p50 / p99 ms | 1 version p50 / p99 ms |\n|---|---|---|---|---|---|---|---|"
    )
    print("\n".join(lines))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def ints(value: str) -> list[int]:
        return [int(x) for x in value.split(",")]

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=lambda s: s.split(","), default=["transformers", "llama_cpp"])
    parser.add_argument("--versions", type=ints, default=[1, 4, 16, 64])
    parser.add_argument("--streams", type=ints, default=[8, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--rounds", type=odd_rounds, default=1)
    parser.add_argument(
        "--threads", type=int, default=1, help="engine threads (1: two OpenMP threads collapse on a shared machine)"
    )
    parser.add_argument("--stacked", action="store_true", help="transformers: the rank-stacked pass at any count")
    return parser.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    asyncio.run(main(parse_args()))
