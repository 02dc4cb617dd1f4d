"""Learning from a population: many simulated users with different, sparse and noisy tastes, one shared adapter
against one adapter per segment of users.

Users (``--users``, identified by the OpenAI ``user`` field as an app sends it) fall in cohorts with the tastes of
:mod:`tastes` (``short``, ``bullets``, ``formal``, ``direct``, naive raters) and one small adversarial cohort
(``--adversarial``, rating the opposite of ``short``). They arrive over the first ``--arrival`` share of the run;
each chats on the training prompts of :mod:`tastes` and rates a ``--rate`` share of its replies, ``--flip`` of the
ratings at random; the ratings are sent once 8 per learning lineage are in hand (the trainer's batch). Traffic goes
through a real gateway + trainer (:class:`live_loop.Loop`, rails on by default).
Mode ``shared``: every signal trains the endpoint's one lineage. Mode ``segments``: one segment per taste cohort
(``POST /admin/endpoints/{name}/segments``, members by ``user``); the adversaries stay unassigned (shared lineage).
At each ``--ratings`` checkpoint, per cohort: the liked share of its held-out prompts (1 seeded sample each, as a
member of the cohort, so its segment's version answers) with a Wilson 95 % interval, the version that served it and
that version's free-form capability score on a stratified prefix of ``freeform_bench.jsonl`` (disjoint from the
gate's); totals: ratings, versions trained / served / rejected, update time, chat tokens per second. A run stops at
``--time-limit-s`` and says so. Results: docs/live-loop.md.

    python bench/population.py --modes shared,segments --ratings 100,500 --json pop.json
    python bench/population.py --users 40 --rate 1 --ratings 16 --capability-items 8 --held 4   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from live_loop import EP, Loop, Session, percentile
from tastes import TASTES, liked, prompt_pools, reply_tokens, taste_short, wilson

from livelora.trainer.capability import BENCH_FILE, load_items, stratified

ADVERSARY = "contrarian"


def cohorts_of(args) -> list[tuple[str, str]]:
    """``(user id, cohort)`` for ``--users`` users: ``--adversarial`` of them contrarians, the rest spread evenly
    over the taste cohorts; shuffled (seeded) so that arrival order mixes the cohorts."""
    tastes = args.tastes.split(",")
    n_adv = round(args.users * args.adversarial)
    names = [ADVERSARY] * n_adv + [tastes[i % len(tastes)] for i in range(args.users - n_adv)]
    random.Random(args.seed).shuffle(names)
    return [(f"user-{i:04d}", c) for i, c in enumerate(names)]


def rates_up(cohort: str, text: str, item) -> bool:
    """The cohort's rating of a reply before noise: its taste (naive), or for contrarians the opposite of short."""
    return not taste_short(text, item) if cohort == ADVERSARY else liked(cohort, "naive", text, item)


class PopulationRun:
    """One mode on a fresh loop: users arrive, chat, rate sparsely and noisily; checkpoints measure per cohort."""

    def __init__(self, args, mode: str, items: list):
        self.args, self.mode, self.items = args, mode, items
        self.users = cohorts_of(args)
        self.train, self.held = prompt_pools()
        self.loop = Loop(args, 8, 8, rails=args.rails == "on", max_wait_s=args.max_wait_s)
        self.s = Session(args, self.loop, mode)
        self.s.client.close()
        self.s.client = httpx.Client(timeout=args.request_timeout)
        self.rng = random.Random(args.seed + 1)
        self.points: list[dict] = []
        self.served: Counter[str] = Counter()
        self.tokens, self.chat_s = 0, 0.0
        # ratings held until a batch's worth per learning lineage is in hand, then sent and trained together: a
        # round of 16 chats at a 15 % rate carries 2 or 3, and waiting for a step on each (the first runs did)
        # spent the hour on steps of 2 or 3 ratings (37 ratings in 25 minutes)
        self.pending: list[tuple[str, bool, str]] = []
        self.flush_at = 8 * (len(args.tastes.split(",")) + 1 if mode == "segments" else 1)
        if mode == "segments":
            self.make_segments()

    def admin(self, path: str, body: dict) -> None:
        r = self.s.client.post(self.loop.server.url(f"/admin/endpoints/{EP}/segments{path}"), json=body)
        if r.status_code >= 300:
            raise RuntimeError(f"{path or 'create'}: {r.status_code} {r.text}")

    def make_segments(self) -> None:
        for cohort in self.args.tastes.split(","):
            self.admin("", {"name": cohort, "reason": "population bench"})
            self.admin(f"/{cohort}/assign", {"users": [u for u, c in self.users if c == cohort]})

    def chat(self, user: str, prompt: str, seed: int, *, temperature: float, max_tokens: int) -> dict:
        body = {
            "model": EP,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
            "user": user,
            "messages": [{"role": "user", "content": prompt}],
        }
        r = self.s.client.post(self.s.chat_url, json=body)
        r.raise_for_status()
        out = r.json()
        self.tokens += out["usage"]["completion_tokens"]
        return out

    def arrived(self, rated: int) -> list[tuple[str, str]]:
        """Users present once ``rated`` ratings were sent: arrival spread over ``--arrival`` of the run."""
        span = max(1.0, self.args.arrival * max(self.args.ratings))
        n = max(len(self.args.tastes.split(",")) + 1, round(len(self.users) * min(1.0, (rated + 1) / span)))
        return self.users[:n]

    def cap(self, cohort: str) -> int:
        """The reply cap a cohort's app asks for (its taste's, :func:`tastes.reply_tokens`; ``--max-tokens`` wins)."""
        return reply_tokens(cohort if cohort in TASTES else "short", self.args.max_tokens)

    def flush(self) -> None:
        """Send the held ratings and wait until the trainer took them (:meth:`live_loop.Session.round`)."""
        if self.pending:  # one gated step per learning lineage, each up to ~5 minutes on a loaded 2-core machine
            self.s.round(self.pending, drain_timeout_s=900 * (self.flush_at // 8))
            self.pending = []

    def round(self, rated: int) -> int:
        """One round of ``--round-chats`` chats by present users; their ratings held, and sent and trained once
        :attr:`flush_at` are in hand (8 per learning lineage). Returns the round's ratings."""
        a = self.args
        who = [self.rng.choice(self.arrived(rated)) for _ in range(a.round_chats)]
        asks = [(u, c, *self.rng.choice(self.train), self.rng.randrange(1 << 30)) for u, c in who]
        t0 = time.perf_counter()
        outs = list(
            self.s.pool.map(
                lambda q: self.chat(q[0], q[2], q[4], temperature=a.temperature, max_tokens=self.cap(q[1])), asks
            )
        )
        self.chat_s += time.perf_counter() - t0
        ratings = []
        for (user, cohort, _, item, _), out in zip(asks, outs):
            self.served[out["system_fingerprint"].removeprefix("livelora-")] += 1
            if self.rng.random() < a.rate:
                up = rates_up(cohort, out["choices"][0]["message"]["content"], item)
                ratings.append((out["id"], up != (self.rng.random() < a.flip), user))
        self.pending += ratings
        if len(self.pending) >= self.flush_at:
            self.flush()
        return len(ratings)

    def measure(self, rated: int) -> dict:
        """Per cohort: liked share on held-out prompts and the capability of the version that served it."""
        a, t0 = self.args, time.perf_counter()
        point: dict = {"ratings": rated, "cohorts": {}}
        capability: dict[str, float] = {}
        for cohort in a.tastes.split(",") + ([ADVERSARY] if any(c == ADVERSARY for _, c in self.users) else []):
            user, cap = next(u for u, c in self.users if c == cohort), self.cap(cohort)
            held = self.held[: a.held]
            outs = list(
                self.s.pool.map(
                    lambda ph, user=user, cap=cap: self.chat(
                        user, ph[1][0], 7_000 + ph[0], temperature=a.temperature, max_tokens=cap
                    ),
                    enumerate(held),
                )
            )
            version = outs[0]["system_fingerprint"].removeprefix("livelora-")
            k = sum(rates_up(cohort, o["choices"][0]["message"]["content"], it) for o, (_, it) in zip(outs, held))
            if version not in capability:
                ask = lambda i, user=user: self.chat(user, i.prompt, 0, temperature=0.0, max_tokens=i.max_tokens)  # noqa: E731
                caps = list(self.s.pool.map(ask, self.items))
                capability[version] = sum(
                    i.right(o["choices"][0]["message"]["content"]) for i, o in zip(self.items, caps)
                ) / len(self.items)
            point["cohorts"][cohort] = {
                "liked": k / len(outs),
                "liked_ci": wilson(k, len(outs)),
                "version": version,
                "capability": capability[version],
            }
        point["measure_s"] = time.perf_counter() - t0
        self.points.append(point)
        line = "; ".join(
            f"{c} {v['liked']:.0%} ({v['version']}, cap {v['capability']:.0%})" for c, v in point["cohorts"].items()
        )
        print(f"[{self.mode}] ratings={rated:5d} {line} (measured in {point['measure_s']:.0f} s)", flush=True)
        return point

    def run(self) -> dict:
        a, t0 = self.args, time.perf_counter()
        stopped = None
        try:
            self.measure(0)
            rated = 0
            for target in sorted(a.ratings):
                while rated < target and stopped is None:
                    rated += self.round(rated)
                    if time.perf_counter() - t0 > a.time_limit_s:
                        stopped = f"time limit {a.time_limit_s:g} s reached at {rated} ratings"
                self.flush()
                self.measure(rated)
                if stopped:
                    break
        finally:
            self.s.close()
        ups = self.s.updates
        times = [u["update_s"] for u in ups if "update_s" in u]
        return {
            "mode": self.mode,
            "points": self.points,
            "stopped": stopped,
            "trained": len(ups),
            "served_versions": sorted(self.served),
            "rejected": sum(not u["passed"] for u in ups),
            "update_p50_s": percentile(times, 50) if times else None,
            "chat_tokens_per_s": self.tokens / self.chat_s if self.chat_s else None,
            "total_s": time.perf_counter() - t0,
        }


def table(results: list[dict]) -> str:
    """Markdown: one row per mode × checkpoint × cohort."""
    rows = [
        "| mode | ratings | cohort | liked (95 % CI) | served by | capability | trained / rejected | update p50 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for p in r["points"]:
            for c, v in p["cohorts"].items():
                lo, hi = v["liked_ci"]
                upd = f"{r['update_p50_s']:.1f} s" if r["update_p50_s"] is not None else "—"
                rows.append(
                    f"| {r['mode']} | {p['ratings']} | {c} | {v['liked']:.0%} ({lo:.0%}–{hi:.0%}) | {v['version']} | "
                    f"{v['capability']:.1%} | {r['trained']} / {r['rejected']} | {upd} |"
                )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="shared,segments", help="shared, segments or both")
    ap.add_argument("--users", type=int, default=200)
    ap.add_argument("--tastes", default="short,bullets,formal,direct", help="taste cohorts, of " + ",".join(TASTES))
    ap.add_argument("--adversarial", type=float, default=0.05, help="share of users rating against 'short'")
    ap.add_argument("--rate", type=float, default=0.15, help="share of replies a user rates")
    ap.add_argument("--flip", type=float, default=0.10, help="share of ratings flipped at random")
    ap.add_argument("--arrival", type=float, default=0.5, help="share of the run over which users arrive")
    ap.add_argument("--ratings", default="100,500", help="checkpoints (ratings sent so far)")
    ap.add_argument("--round-chats", type=int, default=16, help="chats per round (then its ratings train)")
    ap.add_argument("--held", type=int, default=12, help="held-out prompts per cohort measurement")
    ap.add_argument("--capability-items", type=int, default=40, help="stratified prefix of the bench set")
    ap.add_argument("--rails", choices=("on", "off"), default="on")
    ap.add_argument("--time-limit-s", type=float, default=3600, help="stop a mode after this long, and say so")
    ap.add_argument("--max-wait-s", type=float, default=3.0, help="the trainer's max_wait_s")
    ap.add_argument("--max-tokens", type=int, default=None, help="reply cap of every chat (default: per cohort)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--rater-max-events", type=int, default=1000)
    ap.add_argument("--request-timeout", type=float, default=3600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-store", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.ratings = [int(x) for x in args.ratings.split(",")]
    args.kto_lr = args.beta = args.lora_rank = args.lora_alpha = None  # the trainer's defaults (Loop reads these)
    items = stratified(load_items(BENCH_FILE))[: args.capability_items]
    results = [PopulationRun(args, mode, items).run() for mode in args.modes.split(",")]
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
