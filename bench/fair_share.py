"""Fair share: a quiet tenant's time to first token while another tenant floods the engine.

Starts a gateway in a child process (key mode, a fresh store whose base models are linked from the store of
``livelora serve``: ``$LIVELORA_HOME`` or its default, the built-in model converted there if it is not yet) with
two tenants, on the Redis of ``LIVELORA_REDIS_URL`` (default 127.0.0.1:6379); the flood runs in a second child,
so no client shares the gateway's interpreter (an attacker's client runs elsewhere). Tenant ``quiet`` sends
``--requests`` ordinary streaming chats one after another (``--max-tokens`` each), first alone, then while
tenant ``flood`` keeps ``--flooders`` streams busy with the largest requests it may send (``n = max_n``,
``max_tokens = max_n_tokens / n``, ``ignore_eos``; refused ones are retried after 50 ms). Prints the quiet
tenant's TTFT p50/p99 (seconds, from request to first content chunk) and error count in both phases, the
flooded/quiet p99 ratio, and how many of the flood's requests were admitted or refused (429).

    python bench/fair_share.py                        # the defaults (engine batch 8, 64 waiting)
    python bench/fair_share.py --no-share             # tenant_share 1, share_reserve 0: the old behaviour
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

BASE = "smollm2-135m-instruct"


def p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def serve(home: Path, settings: dict, port) -> None:
    """Child process: a gateway on an ephemeral port (sent back through ``port``) until killed."""
    import uvicorn

    from livelora.cli.processes import gateway_app
    from livelora.gateway.settings import GatewaySettings

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = gateway_app(GatewaySettings(model=BASE, home=home, executor_in_process=False, **settings))
    port.put(sock.getsockname()[1])
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


def start(home: Path, **settings) -> tuple[str, mp.Process]:
    """The gateway in a process of its own, so that no client shares its interpreter (and GIL)."""
    ctx = mp.get_context("spawn")
    port = ctx.Queue()
    proc = ctx.Process(target=serve, args=(home, settings, port), daemon=True)
    proc.start()
    url = f"http://127.0.0.1:{port.get(timeout=600)}"
    for _ in range(3000):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit("the gateway did not start")


async def ttft(c: httpx.AsyncClient, max_tokens: int, i: int) -> float | None:
    body = {
        "model": BASE,
        "stream": True,
        "max_tokens": max_tokens,
        "seed": i,
        "messages": [{"role": "user", "content": f"Tell me one fact about the number {i}."}],
    }
    t0 = time.monotonic()
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return None
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                first = time.monotonic() - t0
        return first


async def quiet_phase(url: str, key: str, n: int, max_tokens: int) -> tuple[list[float], int]:
    times, errors = [], 0
    async with httpx.AsyncClient(base_url=url, timeout=600, headers={"Authorization": f"Bearer {key}"}) as c:
        for i in range(n):
            t = await ttft(c, max_tokens, i)
            if t is None:
                errors += 1
            else:
                times.append(t)
    return times, errors


async def flood(url: str, key: str, body: dict, stop, counts: dict) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=None, headers={"Authorization": f"Bearer {key}"}) as c:
        while not stop.is_set():
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                counts[r.status_code] = counts.get(r.status_code, 0) + 1
                if r.status_code != 200:
                    await r.aread()
                    await asyncio.sleep(0.05)
                    continue
                async for _ in r.aiter_lines():
                    if stop.is_set():
                        break


def flood_process(url: str, key: str, body: dict, streams: int, stop, out) -> None:
    """Child process: ``streams`` flood loops until ``stop`` is set; puts the status counts on ``out``."""

    async def main() -> dict:
        counts: dict = {}
        tasks = [asyncio.create_task(flood(url, key, body, stop, counts)) for _ in range(streams)]
        while not stop.is_set():
            await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return counts

    out.put(asyncio.run(main()))


async def run(args) -> None:
    from livelora.core.api_keys import TENANT_ROLES, KeyStore
    from livelora.core.base_models import resolve_base_model
    from livelora.core.quotas import Limits
    from livelora.core.settings import CommonSettings, QuotaSection

    store = CommonSettings().home  # $LIVELORA_HOME, else the default store of `livelora serve`
    resolve_base_model(BASE, store)  # converts the built-in model once, as `livelora serve` would
    home = Path(tempfile.mkdtemp(prefix="fair-share-"))
    (home / "models").symlink_to(Path(store) / "models", target_is_directory=True)
    keys = {t: KeyStore(home).create(t, list(TENANT_ROLES), t)[1] for t in ("flood", "quiet")}
    shares = {"tenant_share": 1.0, "key_share": 1.0, "share_reserve": 0.0} if args.no_share else {}
    url, server = start(home, device="cpu", redis_prefix=f"bench-fair-{os.getpid()}:", **shares)
    limits = Limits.from_settings(QuotaSection())
    n = limits.max_n or 16
    per = (limits.max_n_tokens or 65536) // n
    largest = {
        "model": BASE,
        "stream": True,
        "n": n,
        "max_tokens": per,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Write a very long story."}],
    }
    await quiet_phase(url, keys["quiet"], 2, args.max_tokens)  # warm-up
    quiet, quiet_err = await quiet_phase(url, keys["quiet"], args.requests, args.max_tokens)
    print(f"quiet phase done: TTFT p99 {p(quiet, 0.99):.3f} s, errors {quiet_err}", flush=True)
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    flooder = ctx.Process(target=flood_process, args=(url, keys["flood"], largest, args.flooders, stop, out))
    flooder.start()
    await asyncio.sleep(args.settle_s)
    flooded, flooded_err = await quiet_phase(url, keys["quiet"], args.requests, args.max_tokens)
    print(f"shares: {'off (--no-share)' if args.no_share else 'on (defaults)'}; flood request: n={n} × {per} tokens")
    for name, times, errors in (("quiet", quiet, quiet_err), ("flooded", flooded, flooded_err)):
        print(f"{name:8}: TTFT p50 {p(times, 0.5):.3f} s  p99 {p(times, 0.99):.3f} s  errors {errors}/{args.requests}")
    print(f"p99 flooded / quiet: {p(flooded, 0.99) / p(quiet, 0.99):.2f}")
    sys.stdout.flush()  # the figures first: stopping the flood's long streams can take a while
    stop.set()
    print(f"flood requests by status: {dict(sorted(out.get(timeout=120).items()))}")
    flooder.join(timeout=30)
    server.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20, help="quiet tenant's chats per phase")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--flooders", type=int, default=4, help="concurrent flood streams")
    ap.add_argument("--settle-s", type=float, default=5.0, help="flood time before the quiet tenant starts")
    ap.add_argument("--no-share", action="store_true", help="turn the shares off (tenant_share 1, reserve 0)")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
