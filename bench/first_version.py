"""Time to the first learned version: seconds from a fresh install's 8th rating to the first reply served by ``@1``.

Starts ``livelora serve`` (gateway + trainer, the evaluation gate on, trainer defaults) on a fresh temporary
store with the converted built-in model, chats and rates ``--ratings`` replies (alternating thumbs up/down), then
polls ``GET /v1/learning/<model>`` once a second until it says ``serving @1`` and chats until a reply comes from
``<model>@1`` (``--poll chat``: chats once a second from the start). Prints that time, the stage times of
``GET /v1/learning/<model>`` relative to the last rating, what the feedback answers said was left, and the
machine's load. ``--load N`` keeps N chat streams running in the background throughout.

    python bench/first_version.py                 # idle
    python bench/first_version.py --load 4        # under 4 concurrent streams

Needs Redis (``LIVELORA_REDIS_URL``) and the built-in model converted in ``LIVELORA_HOME``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_loop import PROMPTS
from serve import spawn

MODEL = "smollm2-135m-instruct"


def load_average() -> str:
    """``/proc/loadavg``'s 1, 5 and 15 minute figures."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def chat(client: httpx.Client, prompt: str, max_tokens: int = 16) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    r = client.post("/v1/chat/completions", json={**body, "temperature": 0})
    r.raise_for_status()
    return r


def background(url: str, n: int, stop: threading.Event, counts: list[int]) -> list[threading.Thread]:
    """``n`` threads each streaming chat completions (64 tokens, temperature 0.7) until ``stop``."""

    def run(w: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            i = w
            while not stop.is_set():
                body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
                body.update({"max_tokens": 64, "temperature": 0.7, "stream": True})
                try:
                    with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        for _ in r.iter_lines():
                            pass
                    counts[w] += 1
                except httpx.HTTPError:
                    time.sleep(0.5)
                i += n

    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in range(n)]
    for t in threads:
        t.start()
    return threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratings", type=int, default=8, help="replies rated (the trainer's kto_min_batch is 8)")
    p.add_argument("--load", type=int, default=0, help="concurrent background chat streams")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for @1")
    p.add_argument(
        "--poll",
        choices=("status", "chat"),
        default="status",
        help="after the last rating, poll GET /v1/learning (as the README walkthrough does) until it says serving "
        "@1, then chat once; or chat once a second (the trainer's duty budget then paces the step for serving)",
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()

    from livelora.core.base_models import resolve_base_model
    from livelora.core.settings import CommonSettings

    ref = resolve_base_model(MODEL, CommonSettings().home)
    home = Path(tempfile.mkdtemp(prefix="livelora-first-"))
    env = {
        "LIVELORA_HOME": str(home),
        "LIVELORA_REDIS_PREFIX": f"livelora-bench-{uuid.uuid4().hex[:8]}:",
        "LIVELORA_GATE_ENABLED": "true",
    }
    load_before = load_average()
    t_start = time.perf_counter()
    proc, url = spawn(
        "transformers", str(ref.path), args.max_batch_size, None, env=env, extra=["--served-model-name", MODEL]
    )
    healthy_s = time.perf_counter() - t_start
    stop, counts = threading.Event(), [0] * args.load
    threads = background(url, args.load, stop, counts) if args.load else []
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            left, prompts = [], iter(PROMPTS * 4)
            t_first_chat = time.perf_counter()
            for i in range(args.ratings):
                r = chat(c, next(prompts))
                fb = c.post("/v1/feedback", json={"completion_id": r.json()["id"], "rating": i % 2 == 0})
                fb.raise_for_status()
                left.append(fb.json().get("ratings_to_step"))
            t_last = time.perf_counter()
            wall_last = time.time()
            at_last = c.get(f"/v1/learning/{MODEL}").json()
            served_by, t_served, t_status = None, None, None
            while time.perf_counter() - t_last < args.timeout:
                if args.poll == "status" and t_status is None:
                    if not (c.get(f"/v1/learning/{MODEL}").json().get("serving") or "").endswith("@1"):
                        time.sleep(1.0)
                        continue
                    t_status = time.perf_counter()
                r = chat(c, "What is the capital of France?", max_tokens=4)
                served_by = r.headers.get("x-livelora-adapter-version") or r.json().get("system_fingerprint")
                if served_by and served_by.endswith(f"{MODEL}@1"):
                    t_served = time.perf_counter()
                    break
                time.sleep(1.0)
            status = c.get(f"/v1/learning/{MODEL}").json()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(home, ignore_errors=True)
        from livelora.core.bus import connect_sync

        redis = connect_sync(CommonSettings().redis_url)
        for key in redis.scan_iter(match=env["LIVELORA_REDIS_PREFIX"] + "*", count=500):
            redis.delete(key)
        redis.close()
    marks = [
        (m["stage"], m.get("check") or m.get("detail") or m.get("version"), m["at"] - wall_last)
        for m in status.get("stages", [])
    ]
    figures = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "cpus": os.cpu_count(),
        "background_streams": args.load,
        "background_replies": sum(counts),
        "server_ready_s": round(healthy_s, 1),
        "chat_and_rate_s": round(t_last - t_first_chat, 1),
        "ratings_to_step_answers": left,
        "status_at_last_rating": {k: at_last.get(k) for k in ("stage", "ratings_waiting", "eta_s", "eta_basis")},
        "first_version_s": None if t_served is None else round(t_served - t_last, 1),
        "status_serving_s": None if t_status is None else round(t_status - t_last, 1),
        "stages_s_after_last_rating": [(s, what, round(t, 1)) for s, what, t in marks],
        "step_seconds": status.get("step_seconds"),
        "poll": args.poll,
        "serving_wait_s": (status.get("last") or {}).get("serving_wait_s"),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    if t_served is None:
        raise SystemExit(f"no reply from {MODEL}@1 within {args.timeout} s (last: {served_by})")


if __name__ == "__main__":
    main()
