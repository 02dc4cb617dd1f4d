"""Live-loop latency: from a thumbs rating to the gateway serving the adapter version trained on it.

Starts a gateway (uvicorn, in this process, real engine) on a temporary store and a trainer worker thread on
the same Redis (``LIVELORA_REDIS_URL``, a fresh key prefix). It serves ``--requests`` chat completions, rates
them (alternating up/down), and with ``kto_min_batch = --requests`` the last rating completes a KTO batch.
Printed figures:

* completion-log overhead is inside the chat latency (median chat seconds);
* feedback accept latency (HTTP round trip until the event is in the Redis stream), median and max;
* rating → version written (trainer: read, dataset fsync, KTO step, save) and version written → served
  (notice, engine load, sha256, canary, pointer switch), and their sum.

Prints figures only. Usage: ``python bench/live_loop.py [--requests 4] [--max-tokens 8]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(args) -> None:
    from _server import start_server, wait_until

    from livelora.adapters.bus import Keys, connect_sync
    from livelora.adapters.models import resolve_base_model
    from livelora.adapters.settings import BaseSettings
    from livelora.gateway.settings import GatewaySettings
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.policy import OnlinePolicy, PolicyConfig
    from livelora.trainer.worker import TrainerWorker

    base = BaseSettings()
    ref = resolve_base_model(base.model, base.home)
    home = Path(tempfile.mkdtemp(prefix="livelora-bench-loop-"))
    keys = Keys(f"livelora-bench-{uuid.uuid4().hex[:8]}:")
    ep = "bench-loop"
    server = start_server(GatewaySettings(model=str(ref.path), served_model_name=ep, home=home,
                                          redis_prefix=keys.prefix, max_batch_size=4, device="cpu"))
    redis = connect_sync(base.redis_url)
    worker = TrainerWorker(redis, keys, home, OnlineTrainer(ref, home),
                           OnlinePolicy(PolicyConfig(kto_min_batch=args.requests, max_batch=max(2, args.requests))),
                           consumer="bench", block_ms=50)
    written: dict[str, float] = {}
    stop = threading.Event()

    def trainer() -> None:
        while not stop.is_set():
            for n in worker.poll():
                written[n.name] = time.perf_counter()

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    try:
        chat_s, fb_s, ids = [], [], []
        for i in range(args.requests):
            t0 = time.perf_counter()
            r = httpx.post(server.url("/v1/chat/completions"), timeout=600, json={
                "model": ep, "max_tokens": args.max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"Give me fact number {i} about the sea."}]})
            chat_s.append(time.perf_counter() - t0)
            ids.append(r.json()["id"])
        for i, cid in enumerate(ids):
            t0 = time.perf_counter()
            r = httpx.post(server.url("/v1/feedback"), json={"completion_id": cid, "rating": i % 2 == 0})
            fb_s.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        rated = time.perf_counter()
        name = f"{ep}@1"
        ok = wait_until(lambda: server.app.state.registry.current.get(ep) == name, timeout_s=1800, interval_s=0.01)
        served = time.perf_counter()
        print(f"requests={args.requests} max_tokens={args.max_tokens} store={home}")
        print(f"chat latency median={statistics.median(chat_s):.3f} s (includes the completion-log write)")
        print(f"feedback accept latency median={statistics.median(fb_s) * 1000:.1f} ms max={max(fb_s) * 1000:.1f} ms")
        if ok and name in written:
            print(f"last rating -> {name} written: {written[name] - rated:.2f} s; written -> served: "
                  f"{served - written[name]:.2f} s; total {served - rated:.2f} s")
        else:
            print(f"{name} was not served within the time limit")
    finally:
        stop.set()
        thread.join(timeout=60)
        server.stop()
        for k in redis.scan_iter(match=keys.prefix + "*"):
            redis.delete(k)
        redis.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    main(ap.parse_args())
