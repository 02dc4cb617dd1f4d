"""Hot-swap cost on the transformers engine: how long a new adapter version takes to serve, and what the
swap does to requests running at the same time.

Setup: SmolLM2-135M-Instruct on CPU (or ``--device cuda``), LoRA rank ``--rank`` on attention + MLP, versions
written by the TrainingModel into a temporary store. For each of ``--swaps`` versions it measures
``AdapterRegistry.install`` split into engine load, sha256 check and canary forward pass, and the time the
pointer switch itself takes. Meanwhile ``--clients`` greedy generations of ``--max-tokens`` tokens run in
a loop on the endpoint; the script prints their latency with and without a concurrent install, and checks
every request finished on the version it leased. Prints figures only.

Usage: ``python bench/hotswap.py [--swaps 3] [--clients 4] [--max-tokens 16] [--rank 8] [--device cpu]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path


async def main(args) -> None:
    import torch

    from livelora.adapters.models import resolve_base_model
    from livelora.adapters.settings import BaseSettings
    from livelora.adapters.store import WEIGHTS_FILE, AdapterStore, sha256_file
    from livelora.clients.types.tinker import LoraConfig
    from livelora.gateway.engines import create_engine
    from livelora.gateway.engines.base import SamplingParams
    from livelora.gateway.registry import AdapterRegistry
    from livelora.trainer.model import TrainingModel

    settings = BaseSettings()
    ref = resolve_base_model(settings.model, settings.home)
    home = Path(tempfile.mkdtemp(prefix="livelora-hotswap-"))
    store = AdapterStore(home)
    tm = TrainingModel(ref, LoraConfig(rank=args.rank, train_unembed=False), device=args.device)
    g = torch.Generator().manual_seed(0)
    for _ in range(args.swaps):
        with torch.no_grad():
            for k, p in tm.lora_params.items():
                if "lora_B" in k:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        tm.save_weights(store, "bench")
    del tm
    size = (store.version_dir("bench", 1) / WEIGHTS_FILE).stat().st_size
    engine = create_engine("transformers", model=settings.model, device=args.device, max_batch_size=args.clients)
    await engine.start()
    reg = AdapterRegistry(engine, home, "bench", resync_s=0)
    prompt = engine.tokenizer.encode("Write one sentence about the sea.", add_special_tokens=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    latencies: dict[str, list[float]] = {"idle": [], "during_install": []}
    mismatched = 0
    installing = False
    stop = False

    async def client():
        nonlocal mismatched
        while not stop:
            async with reg.lease("bench") as lease:
                phase = "during_install" if installing else "idle"
                t0 = time.perf_counter()
                async for _ in engine.generate(prompt, params, adapter=lease.adapter):
                    pass
                latencies[phase].append(time.perf_counter() - t0)
                if lease.adapter is not None and lease.adapter not in engine.loaded_adapters():
                    mismatched += 1

    tasks = [asyncio.create_task(client()) for _ in range(args.clients)]
    await asyncio.sleep(2.0)
    rows = []
    for v in range(1, args.swaps + 1):
        manifest = store.get("bench", v)
        path = store.version_dir("bench", v)
        installing = True
        t0 = time.perf_counter()
        await engine.load_adapter(manifest.name, str(path))
        t1 = time.perf_counter()
        await asyncio.to_thread(sha256_file, path / WEIGHTS_FILE)
        t2 = time.perf_counter()
        await engine.score(reg.canary_tokens(), adapter=manifest.name)
        t3 = time.perf_counter()
        await engine.unload_adapter(manifest.name)  # measured once above; now the registry's own install
        t4 = time.perf_counter()
        await reg.install("bench", v)
        t5 = time.perf_counter()
        installing = False
        rows.append((manifest.name, t1 - t0, t2 - t1, t3 - t2, t5 - t4))
        await asyncio.sleep(2.0)
    stop = True
    await asyncio.gather(*tasks)
    await engine.close()

    print(f"device={args.device} rank={args.rank} adapter file={size / 1e6:.2f} MB clients={args.clients} "
          f"max_tokens={args.max_tokens}")
    print(f"{'version':<10} {'load s':>8} {'sha256 s':>9} {'canary s':>9} {'install s':>10}")
    for name, load, sha, canary, total in rows:
        print(f"{name:<10} {load:8.3f} {sha:9.4f} {canary:9.3f} {total:10.3f}")
    for phase, xs in latencies.items():
        if xs:
            print(f"request latency {phase:<15} n={len(xs):3d} median={statistics.median(xs):.3f} s "
                  f"max={max(xs):.3f} s")
    print(f"requests whose leased version was unloaded before they finished: {mismatched}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--swaps", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    asyncio.run(main(ap.parse_args()))
