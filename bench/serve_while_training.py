"""Serving speed while the model learns: the same load with and without training, in one run.

For each trainer placement (``--modes``: ``process``, ``livelora serve``'s default, or ``thread``) it starts a
real ``livelora serve`` on a fresh store and runs ``--concurrency`` chat streams for ``--duration`` seconds
twice: with no ratings (the trainer idle), then with every reply rated (KTO steps all the time). Prints output
tokens/s, inter-token latency p50/p99, time to first token p50 and, for the second phase, each version's update
time and its parts. ``--segments N``: after the warm-up the endpoint gets N segments (admin API), one user each,
and the requests of both phases go round-robin to those N users and one user in no segment, so N segment lineages
and the shared one learn at once; the end prints each lineage's learning status. ``--duty``: the trainer's duty
while serving (``LIVELORA_TRAINER_DUTY_WHILE_SERVING``). Figures only. Method: ``docs/internals/bench.md``.

    python bench/serve_while_training.py --duration 90                # both modes, ~7 minutes
    python bench/serve_while_training.py --modes process --duration 60
    python bench/serve_while_training.py --modes process --duration 60 --segments 4 --duty 0.5

Needs Redis (``LIVELORA_REDIS_URL``) and the built-in model converted in ``LIVELORA_HOME``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_loop import PROMPTS, liked
from serve import one_stream, percentile, spawn

MODEL = "smollm2-135m-instruct"


def start_serve(
    home: Path, prefix: str, mode: str, max_batch_size: int, duty: float | None = None
) -> tuple[subprocess.Popen, str]:
    """``livelora serve`` on a free port with the converted base model, store ``home``; waits for ``/health``.
    ``duty``: ``LIVELORA_TRAINER_DUTY_WHILE_SERVING`` (None: the environment's or the default)."""
    from livelora.core.base_models import resolve_base_model
    from livelora.core.settings import CommonSettings

    ref = resolve_base_model(MODEL, CommonSettings().home)
    env = {
        "LIVELORA_HOME": str(home),
        "LIVELORA_REDIS_PREFIX": prefix,
        "LIVELORA_TRAINER_PROCESS": "true" if mode == "process" else "false",
    }
    if duty is not None:
        env["LIVELORA_TRAINER_DUTY_WHILE_SERVING"] = str(duty)
    return spawn("transformers", str(ref.path), max_batch_size, None, env=env, extra=["--served-model-name", MODEL])


async def phase(
    url: str,
    *,
    rate: bool,
    duration_s: float,
    concurrency: int,
    max_tokens: int,
    seed: int,
    max_ratings: int | None = None,
    users: list[str] | None = None,
) -> dict:
    """``concurrency`` closed-loop streams for ``duration_s`` seconds; with ``rate`` every reply is rated (the
    first ``max_ratings`` replies only, when given). ``users``: the ``user`` field of the requests, round-robin
    (None: none, the shared lineage)."""
    results: list[dict] = []
    rated_at: dict[str, float] = {}  # feedback id -> time the rating was accepted
    first_served: dict[str, float] = {}
    failed = 0
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        stop_at = start + duration_s

        async def worker(w: int) -> None:
            nonlocal failed
            i = w
            while time.perf_counter() < stop_at:
                try:
                    r = await one_stream(
                        client,
                        MODEL,
                        PROMPTS[i % len(PROMPTS)],
                        max_tokens,
                        temperature=0.7,
                        seed=seed + i,
                        ignore_eos=False,
                        user=users[i % len(users)] if users else None,
                    )
                except (httpx.HTTPError, RuntimeError):
                    failed += 1
                    continue
                finally:
                    i += concurrency
                results.append(r)
                first = r["first"] if r["first"] == r["first"] else r["end"]  # NaN: no content chunk
                first_served[r["version"]] = min(first, first_served.get(r["version"], first))
                if rate and (max_ratings is None or len(rated_at) < max_ratings):
                    fb = await client.post(
                        "/v1/feedback", json={"completion_id": r["id"], "rating": liked(r["text"], 20)}
                    )
                    if fb.status_code == 200:
                        rated_at[fb.json()["id"]] = time.perf_counter()
                    else:
                        failed += 1

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - start
    itl = [x for r in results for x in r["itl"]]
    return {
        "elapsed_s": elapsed,
        "requests": len(results),
        "failed": failed,
        "tokens_per_s": sum(r["tokens"] for r in results) / elapsed,
        "itl_p50_ms": 1000 * percentile(itl, 0.5),
        "itl_p99_ms": 1000 * percentile(itl, 0.99),
        "ttft_p50_ms": 1000 * percentile([r["ttft"] for r in results], 0.5),
        "rated": len(rated_at),
        "rated_at": rated_at,
        "first_served": first_served,
    }


def update_times(
    home: Path, rated_at: dict[str, float], first_served: dict[str, float], wall_offset: float
) -> list[dict[str, float]]:
    """Per version in ``trained.jsonl`` whose batch was rated and which was served within the phase: ``total`` =
    first served − last rating of its batch, split into ``wait`` (→ the worker took the batch: queue and the
    scheduler's batching), ``work`` (train + gate + save, ``written_at − started_at``) and ``swap`` (written →
    first reply by it). Seconds; ``wall_offset`` turns the bench's ``perf_counter`` stamps into Unix time."""
    path = home / "data" / "signals" / "trained.jsonl"
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        times = [rated_at[e] for e in rec["event_ids"] if e in rated_at]
        served = first_served.get(rec["version"])
        if times and served is not None and len(times) == len(rec["event_ids"]):
            last, served = max(times) + wall_offset, served + wall_offset
            out.append(
                {
                    "total": served - last,
                    "wait": rec["started_at"] - last,
                    "events": len(rec["event_ids"]),
                    "work": rec["written_at"] - rec["started_at"],
                    "swap": served - rec["written_at"],
                }
            )
    return out


def make_segments(url: str, n: int) -> list[str]:
    """Segments ``s0``..``s<n-1>`` of the endpoint (``POST /admin/endpoints/{name}/segments``; each starts from the
    version the endpoint serves), user ``user-k`` assigned to ``sk``. Returns the users to spread requests over:
    those ``n`` and ``user-<n>``, in no segment (the shared lineage). Raises SystemExit when the admin API refuses."""
    for k in range(n):
        for path, body in (
            ("", {"name": f"s{k}", "reason": "bench/serve_while_training.py --segments"}),
            (f"/s{k}/assign", {"users": [f"user-{k}"]}),
        ):
            r = httpx.post(f"{url}/admin/endpoints/{MODEL}/segments{path}", json=body, timeout=120)
            if r.status_code >= 300:
                raise SystemExit(f"segment s{k}{path or ' create'}: {r.status_code} {r.text}")
    return [f"user-{k}" for k in range(n + 1)]


def learning_lines(url: str) -> list[str]:
    """The endpoint's learning status as printed lines: the shared lineage's summary, then each segment's stage
    (and why it waits for serving, when it does)."""
    from livelora.clients.types.learning import LearningStatus

    try:
        st = LearningStatus.model_validate(httpx.get(f"{url}/v1/learning/{MODEL}", timeout=60).json())
    except (httpx.HTTPError, ValueError) as exc:
        return [f"learning status unavailable: {exc}"]
    lines = [f"shared ({st.lineage}): {st.summary()}"]
    for g in st.segments:
        why = f", deferred: {g.deferred}" if g.deferred else ""
        lines.append(f"segment {g.name}: {g.stage or '-'}{why}; serving {g.serving or 'base'}, {g.versions} versions")
    return lines


def run_mode(mode: str, args) -> dict:
    home = Path(tempfile.mkdtemp(prefix="livelora-bench-swt-"))
    prefix = f"livelora-bench-{uuid.uuid4().hex[:8]}:"
    proc, url = start_serve(home, prefix, mode, args.max_batch_size, args.duty)
    users, learning = None, []
    try:
        # warm-up: one short request (first-call costs); then rated requests until the first version is served,
        # so that the trainer's one-off costs (building its model, measuring the base model for the gate) are
        # not counted as an update, and both phases are served by an adapter version as a live endpoint is
        asyncio.run(phase(url, rate=False, duration_s=1, concurrency=1, max_tokens=4, seed=0))
        warm_until, rated = time.perf_counter() + args.warmup_s, 0
        while time.perf_counter() < warm_until:  # 10 ratings: one batch (kto_min_batch 8, one may be held out)
            warm = asyncio.run(
                phase(
                    url,
                    rate=rated < 10,
                    duration_s=10,
                    concurrency=args.concurrency,
                    max_tokens=args.max_tokens,
                    seed=90000 + rated,
                    max_ratings=10 - rated,
                )
            )
            rated += warm["rated"]
            if any(v != "base" for v in warm["first_served"]):
                break
        else:
            print(f"warning: no version was served within the {args.warmup_s:.0f} s warm-up", flush=True)
        if args.segments:  # after the warm-up: each segment starts from the shared version served now
            users = make_segments(url, args.segments)
        quiet = asyncio.run(
            phase(
                url,
                rate=False,
                duration_s=args.duration,
                concurrency=args.concurrency,
                max_tokens=args.max_tokens,
                seed=1000,
                users=users,
            )
        )
        load = os.getloadavg()[0]
        wall_offset = time.time() - time.perf_counter()
        busy = asyncio.run(
            phase(
                url,
                rate=True,
                duration_s=args.duration,
                concurrency=args.concurrency,
                max_tokens=args.max_tokens,
                seed=5000,
                users=users,
            )
        )
        learning = learning_lines(url)  # where each lineage stands at the end of the rated phase
        time.sleep(1)
        updates = update_times(home, busy["rated_at"], busy["first_served"], wall_offset)
        versions = len([v for v in busy["first_served"] if v != "base"])
        new = len([v for v in busy["first_served"] if v != "base" and v not in quiet["first_served"]])
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        import redis

        r = redis.Redis.from_url(os.environ.get("LIVELORA_REDIS_URL", "redis://127.0.0.1:6379/0"))
        for k in r.scan_iter(match=prefix + "*"):
            r.delete(k)
        shutil.rmtree(home, ignore_errors=True)
    return {
        "mode": mode,
        "quiet": quiet,
        "busy": busy,
        "updates": updates,
        "versions_served": versions,
        "new_versions_served": new,
        "segments": args.segments,
        "learning": learning,
        "load": load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="process,thread", help="comma-separated: process, thread")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds per phase")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument(
        "--warmup-s",
        type=float,
        default=180.0,
        help="rated warm-up until the first version is served, at most this long",
    )
    ap.add_argument(
        "--segments",
        type=int,
        default=0,
        help="spread the requests (and ratings) over this many segments and the shared lineage (0: shared only)",
    )
    ap.add_argument(
        "--duty",
        type=float,
        default=None,
        help="LIVELORA_TRAINER_DUTY_WHILE_SERVING for the server (default: the environment's, else 0.5)",
    )
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    duty = (
        args.duty if args.duty is not None else os.environ.get("LIVELORA_TRAINER_DUTY_WHILE_SERVING", "0.5 (default)")
    )
    print(
        f"{os.cpu_count()} cores; load average at start {os.getloadavg()[0]:.2f}; {args.concurrency} streams, "
        f"{args.max_tokens} tokens, T=0.7, {args.duration:.0f} s per phase; "
        f"{args.segments} segments + the shared lineage learning; trainer duty while serving {duty}",
        flush=True,
    )
    rows = []
    for mode in args.modes.split(","):
        res = run_mode(mode.strip(), args)
        rows.append(res)
        q, b, u = res["quiet"], res["busy"], res["updates"]
        print(f"\ntrainer placement: {res['mode']} (load average after phase 1: {res['load']:.2f})")
        print("| | no ratings | every reply rated (KTO steps running) | ratio |")
        print("|---|---|---|---|")
        print(
            f"| output tokens/s | {q['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
            f"{b['tokens_per_s'] / q['tokens_per_s']:.2f}x |"
        )
        print(
            f"| inter-token latency p50 / p99 (ms) | {q['itl_p50_ms']:.0f} / {q['itl_p99_ms']:.0f} | "
            f"{b['itl_p50_ms']:.0f} / {b['itl_p99_ms']:.0f} | p99 {b['itl_p99_ms'] / q['itl_p99_ms']:.2f}x |"
        )
        print(f"| time to first token p50 (ms) | {q['ttft_p50_ms']:.0f} | {b['ttft_p50_ms']:.0f} | |")
        print(f"| requests (failed) | {q['requests']} ({q['failed']}) | {b['requests']} ({b['failed']}) | |")
        if u:

            def p50(key: str, u: list[dict] = u) -> float:
                return statistics.median(x[key] for x in u)

            upd = (
                f"p50 {p50('total'):.1f} s, max {max(x['total'] for x in u):.1f} s over {len(u)} versions; "
                f"of it p50 wait {p50('wait'):.1f} s, train + gate + save {p50('work'):.1f} s, "
                f"swap {p50('swap'):.2f} s; events per version p50 {p50('events'):.0f}"
            )
        else:
            upd = "no version both trained and served within the phase"
        print(
            f"ratings {b['rated']}, versions served {res['versions_served']} ({res['new_versions_served']} first "
            f"served in this phase); update (last rating of the batch -> first reply by the version): {upd}",
            flush=True,
        )
        for line in res["learning"]:
            print(f"  {line}", flush=True)
    if args.json:
        for r in rows:
            for ph in ("quiet", "busy"):
                r[ph] = {k: v for k, v in r[ph].items() if k not in ("rated_at", "first_served")}
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
