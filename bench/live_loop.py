"""The live loop, measured: does thumbs-up/down feedback teach the served model a user's taste, and how fast?

Starts a gateway (real SmolLM2 engine) on a fresh temporary store and a trainer worker thread on the same Redis
(``LIVELORA_REDIS_URL``, a fresh key prefix). The default taste run: a simulated user who likes replies of at most
``--max-words`` words chats and rates every reply; the liked share on held-out prompts is measured every
``--eval-every`` ratings, with the update times. ``--scenario a|b|c|d`` runs the update-safety rails scenarios
(one honest user, rails off vs on, an adversary, a bad and a disliked version); ``--latency`` the feedback
latency. Method and recorded results: ``docs/internals/bench.md``.

Usage::

    python bench/live_loop.py                      # taste run with the trainer defaults
    python bench/live_loop.py --kto-lr 1e-4 --beta 0.1 --kto-batch 8 --plot /tmp/curve.png
    python bench/live_loop.py --scenario a          # then b --arms off --b-rails-on-from bench/out/live_loop_a.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

#: Short everyday questions. The first TRAIN_SIZE are the train pool; the rest are held out.
PROMPTS = [
    "What is the capital of France?",
    "How do I boil an egg?",
    "Why is the sky blue?",
    "What should I eat for breakfast?",
    "How many legs does a spider have?",
    "What is a good name for a cat?",
    "How do I make tea?",
    "What is the tallest mountain?",
    "Why do leaves change colour?",
    "How far is the moon?",
    "What is photosynthesis?",
    "How can I sleep better?",
    "What is the boiling point of water?",
    "Who wrote Romeo and Juliet?",
    "How do I tie a tie?",
    "What is a prime number?",
    "Why do cats purr?",
    "How do I clean a cast iron pan?",
    "What is the largest ocean?",
    "How do bees make honey?",
    "What is gravity?",
    "How do I start running?",
    "What is the speed of light?",
    "Why is exercise good for you?",
    "How do I water a cactus?",
    "What is the capital of Japan?",
    "How do rainbows form?",
    "What is a healthy snack?",
    "How many days are in a leap year?",
    "What does a dentist do?",
    "How do I save money?",
    "What is the biggest planet?",
    "Why do we dream?",
    "How do I make pancakes?",
    "What is the freezing point of water?",
    "Who painted the Mona Lisa?",
    "How do I learn to swim?",
    "What is an atom?",
    "Why do birds migrate?",
    "How do I fix a flat bike tyre?",
    "What is the capital of Italy?",
    "How do volcanoes erupt?",
    "What is a good houseplant?",
    "How many hours should I sleep?",
    "What is the smallest country?",
    "How do I write a thank-you note?",
    "Why is the ocean salty?",
    "What is a verb?",
    # held out
    "What is the capital of Spain?",
    "How do I cook rice?",
    "Why do we have seasons?",
    "What is a good dog name?",
    "How many continents are there?",
    "How do I stay focused?",
    "What is the longest river?",
    "Why do stars twinkle?",
    "How do I make coffee?",
    "What is a noun?",
    "How do plants grow?",
    "What is the hottest planet?",
    "How do I stretch my back?",
    "Who invented the telephone?",
    "Why is the grass green?",
    "How do I plant a tree?",
]
TRAIN_SIZE = 48
EP = "bench-loop"


def liked(text: str, max_words: int) -> bool:
    """The simulated user's taste: a non-empty reply of at most ``max_words`` whitespace-separated words."""
    return 1 <= len(text.split()) <= max_words


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] of a non-empty list."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


class Loop:
    """A gateway + trainer worker thread on a fresh store and Redis prefix (``close()`` removes the keys).

    With ``rails`` the trainer runs the evaluation gate (:class:`~livelora.trainer.settings.GateSection`
    defaults) and feedback governance (:class:`~livelora.trainer.signal_governor.FeedbackGovernor`: rate limit
    ``--rater-max-events`` per hour, batch share, rater agreement weighting) and the gateway its automatic
    rollback; without, none of them (the loop of earlier rounds). ``training`` overrides trainer settings
    (e.g. ``sft_lr``). The worker thread's polling can be paused (:attr:`paused`); every step's train + gate +
    save time is recorded in :attr:`trained` (version name → (start, end), ``perf_counter`` seconds).
    """

    def __init__(
        self, args, kto_min_batch: int, max_batch: int, *, rails: bool = False, max_wait_s: float = 30.0, **training
    ):
        from harness.server import start_server

        from livelora.core.base_models import resolve_base_model
        from livelora.core.bus import connect_sync
        from livelora.core.redis_keys import KeyLayout
        from livelora.core.settings import CommonSettings
        from livelora.gateway.settings import GatewaySettings
        from livelora.trainer.online import OnlineTrainer
        from livelora.trainer.scheduler import BatchScheduler
        from livelora.trainer.settings import GateSection, TrainingSection
        from livelora.trainer.signal_governor import FeedbackGovernor
        from livelora.trainer.worker import TrainerWorker

        base = CommonSettings()
        self.ref = ref = resolve_base_model(base.model, base.home)
        d = TrainingSection.model_fields
        self.rails = rails
        self.hparams = {
            "kto_lr": args.kto_lr if args.kto_lr is not None else d["kto_lr"].default,
            "beta": args.beta if args.beta is not None else d["beta"].default,
            "lora_rank": args.lora_rank if args.lora_rank is not None else d["lora_rank"].default,
            "lora_alpha": args.lora_alpha if args.lora_alpha is not None else d["lora_alpha"].default,
            "kto_min_batch": kto_min_batch,
            "max_batch": max_batch,
            "rails": rails,
            **training,
        }
        self.keep_store = args.keep_store
        self.home = Path(tempfile.mkdtemp(prefix="livelora-bench-loop-"))
        self.keys = KeyLayout(f"livelora-bench-{uuid.uuid4().hex[:8]}:")
        self.server = start_server(
            GatewaySettings(
                model=str(ref.path),
                served_model_name=EP,
                home=self.home,
                redis_prefix=self.keys.prefix,
                max_batch_size=args.max_batch_size,
                max_waiting=64,
                device="cpu",
                rollback_enabled=rails,
            )
        )
        self.redis = connect_sync(base.redis_url)
        h = self.hparams
        self.config = TrainingSection(
            lora_rank=h["lora_rank"],
            lora_alpha=h["lora_alpha"],
            kto_lr=h["kto_lr"],
            beta=h["beta"],
            kto_min_batch=kto_min_batch,
            max_batch=max_batch,
            max_wait_s=max_wait_s,
            rater_max_events=args.rater_max_events,
            **training,
        )
        self.backend = backend = OnlineTrainer(ref, self.home, self.config, GateSection(gate_enabled=rails))
        backend.warm_up()  # as TrainerWorker.run() does in `livelora serve` / `livelora trainer`
        self.trained: dict[str, tuple[float, float]] = {}
        train = backend.train

        self.busy, self.last_active = False, time.perf_counter()

        def timed(batch):
            t0 = time.perf_counter()
            self.busy = True
            try:
                m = train(batch)
            finally:
                self.busy, self.last_active = False, time.perf_counter()
            self.trained[m.name] = (t0, time.perf_counter())
            return m

        backend.train = timed
        c = self.config
        self.governor = (
            FeedbackGovernor(self.redis, self.keys, self.home, max_events=c.rater_max_events, window_s=c.rater_window_s)
            if rails
            else None
        )
        self.worker = TrainerWorker(
            self.redis,
            self.keys,
            self.home,
            backend,
            BatchScheduler(c),
            consumer="bench",
            block_ms=50,
            governor=self.governor,
        )
        self.written: dict[str, float] = {}
        self.polls = 0
        self.paused = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.paused.is_set():
                time.sleep(0.02)
                continue
            for n in self.worker.poll():
                self.written[n.name] = time.perf_counter()
            self.polls += 1

    def served(self, endpoint: str = EP) -> str | None:
        return self.server.services.registry.current.get(endpoint)

    def endpoint_of(self, name: str) -> str:
        """The binding that serves version ``name``'s lineage: the endpoint, or one of its segments (``E::S``)."""
        from livelora.adapters.endpoints import EndpointStore

        lineage = name.rsplit("@", 1)[0]
        return next((e for e, b in EndpointStore(self.home).all().items() if b.lineage == lineage), EP)

    def manifest(self, name: str):
        from livelora.adapters.store import AdapterStore

        lineage, version = name.rsplit("@", 1)
        return AdapterStore(self.home).get(lineage, int(version))

    def passed(self, name: str) -> bool:
        """Whether the gate let ``name`` serve its binding (True without a gate)."""
        from livelora.core.rails import gate_allows

        return gate_allows(self.manifest(name).gate, self.endpoint_of(name))

    def drain(self, since: float, timeout_s: float = 900) -> None:
        """Wait until the worker has taken every signal sent up to ``since`` (``perf_counter``): trained, held
        out or quarantined, or left queued because no batch can form (a lone rating, a rater's surplus beyond
        its batch share): then nothing has trained for ``max_wait_s`` + 2 s. Such leftovers train with the next
        round's ratings."""
        from harness.server import wait_until

        quiet = self.config.max_wait_s + 2.0

        def idle() -> bool:
            if self.busy:
                return False
            queued, unread = len(self.worker.scheduler), self.redis.xlen(self.keys.signals)
            if queued == 0 and unread == 0:
                return True
            return unread <= queued and time.perf_counter() - max(since, self.last_active) >= quiet

        if not wait_until(idle, timeout_s=timeout_s, interval_s=0.02):
            raise RuntimeError(f"the trainer did not take the signals within {timeout_s} s")
        n = self.polls
        wait_until(lambda: self.polls >= n + 2 or self.paused.is_set(), timeout_s=60, interval_s=0.01)

    def settle(self, before: set[str], timeout_s: float = 600) -> list[dict]:
        """After :meth:`drain`: the versions written since ``before`` (names), each with its verdict, and once
        the newest that passed is served (or rolled back), when."""
        from harness.server import wait_until

        new = sorted((n for n in self.written if n not in before), key=lambda n: int(n.rsplit("@", 1)[1]))
        out = [
            {"version": n, "passed": self.passed(n), "written": self.written[n], "train": self.trained.get(n)}
            for n in new
        ]
        newest: dict[str, dict] = {}  # per lineage, its newest version that passed
        for u in out:
            if u["passed"]:
                newest[u["version"].rsplit("@", 1)[0]] = u
        for last in newest.values():
            ep = self.endpoint_of(last["version"])
            if not wait_until(
                lambda: self.served(ep) == last["version"] or last["version"] in self.blocked(ep),  # noqa: B023
                timeout_s=timeout_s,
                interval_s=0.01,
            ):
                raise RuntimeError(f"{last['version']} was not served within {timeout_s} s")
            last["served"] = time.perf_counter()
        return out

    def blocked(self, endpoint: str = EP) -> list[str]:
        from livelora.adapters.endpoints import EndpointStore

        b = EndpointStore(self.home).get(endpoint)
        return [f"{b.lineage}@{v}" for v in (getattr(b, "blocked", None) or [])]

    def stats(self) -> dict:
        return httpx.get(self.server.url(f"/admin/endpoints/{EP}/stats"), timeout=60).json()

    def history(self, action: str) -> list[dict]:
        r = httpx.get(self.server.url(f"/admin/endpoints/{EP}/history"), timeout=60).json()
        return [h for h in r.get("data", r if isinstance(r, list) else []) if h.get("action") == action]

    def raters(self) -> list[dict]:
        return httpx.get(self.server.url("/admin/raters"), timeout=60).json()["data"]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        self.server.stop()
        for k in self.redis.scan_iter(match=self.keys.prefix + "*"):
            self.redis.delete(k)
        self.redis.close()
        if not self.keep_store:  # 25 versions with optimizer state are ~280 MB
            shutil.rmtree(self.home, ignore_errors=True)


class ProbeMeter:
    """Capability-probe accuracy (the gate's probes, ``trainer/rails/probes.jsonl``) of stored versions, on a
    model of its own in the bench process (one forward pass of the 24 probes per version)."""

    def __init__(self, loop: Loop):
        from livelora.trainer.gate_measure import ProbeSuite
        from livelora.trainer.model import TrainingModel

        self.loop = loop
        self.model = TrainingModel(loop.ref, loop.config.lora, device="cpu")
        self.suite = ProbeSuite(loop.backend.tokenizer)
        self.cache: dict[str, float] = {}

    def accuracy(self, version: str) -> float:
        from livelora.adapters.store import AdapterStore

        if version not in self.cache:
            if version == "base":
                right, _ = self.suite.probe_logprobs(self.model, adapter=False)
            else:
                self.model.load_state(
                    AdapterStore(self.loop.home), EP, int(version.rsplit("@", 1)[1]), with_optimizer=False
                )
                right, _ = self.suite.probe_logprobs(self.model)
            self.cache[version] = sum(right) / len(right)
        return self.cache[version]


def chat(
    client: httpx.Client, url: str, content: str, *, max_tokens: int, temperature: float, seed: int, n: int = 1
) -> dict:
    r = client.post(
        url,
        json={
            "model": EP,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
            "n": n,
            "messages": [{"role": "user", "content": content}],
        },
    )
    r.raise_for_status()
    return r.json()


def post_ratings(client: httpx.Client, url: str, items: list[tuple[str, bool, str]], pool) -> None:
    """Send ``(completion_id, thumbs_up, user)`` ratings concurrently (one round arrives within a moment)."""

    def one(it):
        r = client.post(url, json={"completion_id": it[0], "rating": it[1], "user": it[2]})
        assert r.status_code == 200, r.text

    list(pool.map(one, items))


class Session:
    """One scenario run's loop, HTTP client, thread pool and measurements (liked share, probes, updates)."""

    def __init__(self, args, loop: Loop, label: str, probes: bool = False):
        self.args, self.loop, self.label = args, loop, label
        self.pool = ThreadPoolExecutor(max_workers=32)
        self.client = httpx.Client(timeout=600)
        self.chat_url, self.fb_url = loop.server.url("/v1/chat/completions"), loop.server.url("/v1/feedback")
        self.curve: list[dict] = []
        self.updates: list[dict] = []
        self.probes = ProbeMeter(loop) if probes else None
        self.rng = random.Random(args.seed)
        self.order: list[str] = []
        self.fingerprints: Counter[str] = Counter()

    def chats(self, prompts: list[str], seeds: list[int]) -> list[dict]:
        outs = list(
            self.pool.map(
                lambda ps: chat(
                    self.client,
                    self.chat_url,
                    ps[0],
                    max_tokens=self.args.max_tokens,
                    temperature=self.args.temperature,
                    seed=ps[1],
                ),
                zip(prompts, seeds),
            )
        )
        self.fingerprints.update(o["system_fingerprint"].removeprefix("livelora-") for o in outs)
        return outs

    def next_prompts(self, n: int) -> tuple[list[str], list[int]]:
        train = PROMPTS[:TRAIN_SIZE]
        while len(self.order) < n:
            self.order += self.rng.sample(train, len(train))
        prompts, self.order = self.order[:n], self.order[n:]
        return prompts, [self.rng.randrange(1 << 30) for _ in prompts]

    def evaluate(self, events: int) -> None:
        args, held = self.args, PROMPTS[TRAIN_SIZE:]
        t0 = time.perf_counter()
        outs = list(
            self.pool.map(
                lambda ip: chat(
                    self.client,
                    self.chat_url,
                    ip[1],
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    seed=10_000 + 100 * ip[0],
                    n=args.eval_samples,
                ),
                enumerate(held),
            )
        )
        texts = [c["message"]["content"] for o in outs for c in o["choices"]]
        words = [len(t.split()) for t in texts]
        share = sum(liked(t, args.max_words) for t in texts) / len(texts)
        version = outs[0]["system_fingerprint"].removeprefix("livelora-")
        point = {
            "events": events,
            "liked": share,
            "samples": len(texts),
            "version": version,
            "median_words": statistics.median(words),
            "example": texts[0],
        }
        if self.probes is not None:
            point["probe_accuracy"] = self.probes.accuracy(version)
        point["eval_s"] = time.perf_counter() - t0
        self.curve.append(point)
        probe = f" probes={point['probe_accuracy']:6.1%}" if "probe_accuracy" in point else ""
        print(
            f"[{self.label}] events={events:4d} version={version:16s} liked={share:6.1%} ({len(texts)} samples)"
            f"{probe} median words={statistics.median(words):5.1f} eval {point['eval_s']:5.1f} s | "
            f"{texts[0][:60]!r}",
            flush=True,
        )

    def round(self, ratings: list[tuple[str, bool, str]], drain_timeout_s: float = 900) -> list[dict]:
        """Send one round's ratings, wait until the trainer took them (at most ``drain_timeout_s``) and the newest
        passing version serves; records and prints each version written."""
        before = set(self.loop.written)
        post_ratings(self.client, self.fb_url, ratings, self.pool)
        rated = time.perf_counter()
        self.loop.drain(rated, drain_timeout_s)
        ups = self.loop.settle(before)
        for u in ups:
            u["rated"] = rated
            t0, t1 = u["train"] or (u["written"], u["written"])
            u["train_gate_save_s"] = t1 - t0
            if "served" in u:
                u["swap_s"] = u["served"] - u["written"]
                u["update_s"] = u["train_gate_save_s"] + u["swap_s"]
                u["rating_to_served_s"] = u["served"] - rated
            gate = self.loop.manifest(u["version"]).gate or {}
            u["gate_s"] = gate.get("seconds")
            verdict = (gate.get("verdicts") or {}).get(EP) or (gate.get("verdicts") or {}).get("*") or {}
            u["failed"] = verdict.get("failed", [])
            u["probe_accuracy_gate"] = (gate.get("measures") or {}).get("probe_accuracy")
            tries = gate.get("line_search") or []
            u["step_scale"] = gate.get("step_scale", 1.0) if gate else None
            u["line_search"] = [[t["step_scale"], t["passed"], t["failed"]] for t in tries]
            u["candidates_rejected"] = sum(1 for t in tries if not t["passed"])
            searched = "; line search " + ", ".join(
                f"α {t['step_scale']:g} " + ("passed" if t["passed"] else "failed " + "+".join(t["failed"]))
                for t in tries
            )
            print(
                f"  [{self.label}] {u['version']}: "
                + (f"passed at α {u['step_scale'] or 1:g}" if u["passed"] else "REJECTED " + str(u["failed"]))
                + (searched if len(tries) > 1 else "")
                + f"; train+gate+save {u['train_gate_save_s']:.2f} s"
                + (f" (gate {u['gate_s']:.2f} s)" if u["gate_s"] else "")
                + (f", swap {u['swap_s']:.2f} s, update {u['update_s']:.2f} s" if "swap_s" in u else ""),
                flush=True,
            )
        self.updates += [{k: v for k, v in u.items() if k not in ("written", "rated", "served", "train")} for u in ups]
        return ups

    def update_summary(self) -> dict:
        done = [u["update_s"] for u in self.updates if "update_s" in u]
        if not done:
            return {"line_search": self.line_search_summary()}
        return {
            "line_search": self.line_search_summary(),
            "p50": percentile(done, 50),
            "max": max(done),
            "n": len(done),
            "train_gate_save_p50": statistics.median(u["train_gate_save_s"] for u in self.updates),
            "swap_p50": statistics.median(u["swap_s"] for u in self.updates if "swap_s" in u),
            "rejected": sum(1 for u in self.updates if not u["passed"]),
        }

    def line_search_summary(self) -> dict:
        """The gate's line search over the run: candidates rejected, and the α of each version that passed."""
        return {
            "candidates_rejected": sum(u.get("candidates_rejected", 0) for u in self.updates),
            "versions_rejected": sum(1 for u in self.updates if not u["passed"]),
            "alpha": {u["version"]: u.get("step_scale") for u in self.updates if u["passed"]},
        }

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()
        self.loop.close()


def load_line() -> str:
    """The machine's load averages (1, 5, 15 min) and core count, for the record."""
    import os

    la = os.getloadavg()
    return f"load average {la[0]:.1f} / {la[1]:.1f} / {la[2]:.1f} on {os.cpu_count()} cores"


def taste(args, *, rails: bool, label: str, probes: bool = False) -> dict:
    """The honest user of the taste run (one rater, ``--kto-batch`` ratings per round, ``--events`` in all),
    with or without the rails. Returns the curve, the updates and their summary."""
    loop = Loop(args, kto_min_batch=args.kto_batch, max_batch=args.kto_batch, rails=rails, max_wait_s=3.0)
    s = Session(args, loop, label, probes=probes)
    t0 = time.perf_counter()
    try:
        s.evaluate(0)
        events = 0
        while events < args.events:
            prompts, seeds = s.next_prompts(args.kto_batch)
            outs = s.chats(prompts, seeds)
            ratings = [(o["id"], liked(o["choices"][0]["message"]["content"], args.max_words), "user") for o in outs]
            s.round(ratings)
            events += len(ratings)
            if events % args.eval_every == 0 or events >= args.events:
                s.evaluate(events)
        quarantined = len(httpx.get(loop.server.url("/admin/quarantine"), timeout=60).json()["data"])
    finally:
        s.close()
    return {
        "label": label,
        "rails": rails,
        "settings": loop.hparams,
        "curve": s.curve,
        "updates": s.updates,
        "update": s.update_summary(),
        "quarantined": quarantined,
        "total_s": time.perf_counter() - t0,
        "gain_pp": 100 * (max(c["liked"] for c in s.curve[1:]) - s.curve[0]["liked"]) if len(s.curve) > 1 else 0.0,
    }


def print_update(r: dict) -> None:
    u = r["update"]
    ls = u.get("line_search")
    if ls and r["rails"]:
        print(
            f"[{r['label']}] line search: {ls['candidates_rejected']} candidate(s) rejected, "
            f"{ls['versions_rejected']} version(s) held back; α per published version: "
            + (", ".join(f"{v.rsplit('@', 1)[1]}:{a:g}" for v, a in ls["alpha"].items()) or "-")
        )
    if "p50" in u:
        print(
            f"[{r['label']}] update (train + {'gate + ' if r['rails'] else ''}save + swap): p50 {u['p50']:.2f} s, "
            f"max {u['max']:.2f} s over {u['n']} served updates (train+gate+save p50 {u['train_gate_save_p50']:.2f}"
            f" s, swap p50 {u['swap_p50']:.2f} s); {u['rejected']} version(s) rejected by the gate"
        )


def scenario_a(args) -> dict:
    """(a) The honest user with the rails on: the liked share must still rise by ≥ 30 points within 200 ratings."""
    r = taste(args, rails=True, label="a rails on", probes=True)
    c = r["curve"]
    within = [p for p in c if p["events"] <= 200]
    gain = 100 * (max(p["liked"] for p in within) - c[0]["liked"])
    print(
        f"\n(a) liked share {c[0]['liked']:.1%} -> "
        + ", ".join(f"{p['liked']:.1%}@{p['events']}" for p in c[1:])
        + f"; best gain within 200 ratings {gain:+.1f} pp (target +30): {'MET' if gain >= 30 else 'NOT MET'}"
    )
    print_update(r)
    print(f"quarantined ratings: {r['quarantined']}; {load_line()}")
    out = {"scenario": "a", "run": r, "gain_within_200_pp": gain, "met": gain >= 30, "load": load_line()}
    plot_curves(out, [r], Path(args.plot).with_name("live_loop_a.png"), "(a) honest user, rails on")
    return out


def scenario_b(args) -> dict:
    """(b) The blunt taste at the default rate, rails off vs on: liked share and probe accuracy per point."""
    runs = []
    for arm in args.arms.split(","):
        if arm == "on" and args.b_rails_on_from:  # the rails-on arm is scenario (a)'s run: reuse its figures
            runs.append(json.loads(Path(args.b_rails_on_from).read_text())["run"] | {"label": "b rails on"})
            continue
        runs.append(taste(args, rails=arm == "on", label=f"b rails {arm}", probes=True))
    print("\n(b) ratings -> liked share / probe accuracy per run (" + " | ".join(r["label"] for r in runs) + ")")
    for points in zip(*(r["curve"] for r in runs)):
        print(
            f"  {points[0]['events']:4d}  "
            + "  |  ".join(f"{p['liked']:6.1%} / {p['probe_accuracy']:6.1%}" for p in points)
        )
    base = runs[0]["curve"][0]["probe_accuracy"]
    out = {"scenario": "b", "runs": runs, "probe_base": base, "load": load_line()}
    for r in runs:
        worst = min(p["probe_accuracy"] for p in r["curve"])
        r["probe_worst"], r["probe_within_5pp"] = worst, 100 * (base - worst) <= 5 + 1e-9
        print(
            f"[{r['label']}] probe accuracy: base {base:.1%}, lowest served {worst:.1%} "
            f"({100 * (worst - base):+.1f} pp; within 5 points: {'yes' if r['probe_within_5pp'] else 'NO'}); "
            f"liked share best {max(p['liked'] for p in r['curve']):.1%}"
        )
        print_update(r)
    for r in runs:
        gain = 100 * (max(p["liked"] for p in r["curve"] if p["events"] <= 200) - r["curve"][0]["liked"])
        r["gain_within_200_pp"] = gain
        print(f"[{r['label']}] liked share gain within 200 ratings {gain:+.1f} pp")
        if r["rails"]:  # issue 34's target for the rails-on arm
            best = max(p["liked"] for p in r["curve"] if p["events"] <= 200)
            r["target_met"] = best >= 0.9 - 1e-9 and r["probe_within_5pp"]
            print(
                f"[{r['label']}] target (liked share >= 90 % within 200 ratings: {best:.1%}; lowest served probe "
                f"accuracy within 5 points of the base): {'MET' if r['target_met'] else 'NOT MET'}"
            )
    print(load_line())
    plot_curves(
        out, runs, Path(args.plot).with_name("live_loop_b.png"), "(b) blunt taste, rails off vs on", probes=True
    )
    return out


def scenario_c(args) -> dict:
    """(c) An adversarial rater sending half of all ratings with inverted labels (see the module docstring)."""
    honest = [f"user{i}" for i in range(4)]
    n_h, n_double, n_own = args.kto_batch, args.kto_batch // 2, args.kto_batch // 2
    per_round = n_h + n_double + n_h + n_own
    loop = Loop(args, kto_min_batch=per_round, max_batch=per_round, rails=not args.rails_off, max_wait_s=3.0)
    s = Session(args, loop, "c rails " + ("off" if args.rails_off else "on"))
    t0 = time.perf_counter()
    adversary_ratings = honest_ratings = 0
    weights: list[dict] = []
    try:
        s.evaluate(0)
        events, k = 0, 0
        while events < args.events:
            prompts, seeds = s.next_prompts(n_h + n_own)
            outs = s.chats(prompts, seeds)
            mine, theirs = outs[:n_h], outs[n_h:]
            ratings = []
            for i, o in enumerate(mine):
                good = liked(o["choices"][0]["message"]["content"], args.max_words)
                owner = honest[(k + i) % len(honest)]
                ratings.append((o["id"], good, owner))
                if i < n_double:  # a second honest user rates half of them too
                    ratings.append((o["id"], good, honest[(k + i + 1) % len(honest)]))
                ratings.append((o["id"], not good, "adversary"))
            for o in theirs:  # and the adversary's own chats, inverted
                ratings.append((o["id"], not liked(o["choices"][0]["message"]["content"], args.max_words), "adversary"))
            k += 1
            adversary_ratings += sum(1 for r in ratings if r[2] == "adversary")
            honest_ratings += sum(1 for r in ratings if r[2] != "adversary")
            s.round(ratings)
            events += len(ratings)
            if loop.rails:
                w = {r["rater"]: r["weight"] for r in loop.raters()}
                weights.append({"events": events, **w})
                print("  rater weights: " + ", ".join(f"{r}={x:.2f}" for r, x in sorted(w.items())), flush=True)
            if k % args.eval_rounds == 0 or events >= args.events:
                s.evaluate(events)
        quarantined = len(httpx.get(loop.server.url("/admin/quarantine"), timeout=60).json()["data"])
    finally:
        s.close()
    c = s.curve
    within = [p for p in c if p["events"] <= 300]
    gain = 100 * (max(p["liked"] for p in within) - c[0]["liked"])
    r = {
        "label": s.label,
        "rails": loop.rails,
        "settings": loop.hparams,
        "curve": c,
        "updates": s.updates,
        "update": s.update_summary(),
        "quarantined": quarantined,
        "total_s": time.perf_counter() - t0,
    }
    print(
        f"\n(c) {s.label}: {honest_ratings} honest and {adversary_ratings} inverted ratings "
        f"({100 * adversary_ratings / max(1, honest_ratings + adversary_ratings):.0f} % adversarial); "
        f"{quarantined} quarantined"
    )
    print(
        f"(c) honest users' liked share {c[0]['liked']:.1%} -> "
        + ", ".join(f"{p['liked']:.1%}@{p['events']}" for p in c[1:])
        + f"; best gain within 300 ratings {gain:+.1f} pp (target +30): {'MET' if gain >= 30 else 'NOT MET'}"
    )
    if weights:
        print(f"(c) final rater weights: {weights[-1]}")
    print_update(r)
    print(load_line())
    out = {
        "scenario": "c",
        "run": r,
        "weights": weights,
        "gain_within_300_pp": gain,
        "met": gain >= 30,
        "honest_ratings": honest_ratings,
        "adversary_ratings": adversary_ratings,
        "load": load_line(),
    }
    plot_curves(
        out,
        [r],
        Path(args.plot).with_name("live_loop_c.png"),
        f"(c) adversary inverts half of all ratings, {s.label}",
        weights=weights,
    )
    return out


def scenario_d(args) -> dict:
    """(d) A deliberately bad version published into the loop, and a version users dislike (module docstring)."""
    from harness.server import wait_until

    loop = Loop(
        args,
        kto_min_batch=args.kto_batch,
        max_batch=32,
        rails=True,
        max_wait_s=3.0,
        sft_lr=args.d_bad_lr,
        sft_min_batch=args.kto_batch,
    )
    s = Session(args, loop, "d")
    t0 = time.perf_counter()
    out: dict = {"scenario": "d"}
    try:
        for _ in range(args.d_warmup_rounds):  # the honest loop first
            prompts, seeds = s.next_prompts(args.kto_batch)
            outs = s.chats(prompts, seeds)
            s.round([(o["id"], liked(o["choices"][0]["message"]["content"], args.max_words), "user") for o in outs])
        good = loop.served()
        # 1. a deliberately bad version: SFT at --d-bad-lr (100x the default) on one content-free phrase
        before = set(loop.written)
        prompts, _ = s.next_prompts(args.kto_batch)
        for q in prompts:
            r = s.client.post(
                loop.server.url("/v1/demonstrations"),
                json={
                    "model": EP,
                    "user": "user",
                    "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": BAD_REPLY}],
                },
            )
            assert r.status_code == 200, r.text
        loop.drain(time.perf_counter())
        bad = s.loop.settle(before)
        s.updates += [{"version": u["version"], "passed": u["passed"]} for u in bad]
        bad_names = [u["version"] for u in bad]
        verdicts = {  # (passed, failed checks, α written, the line search: [α, passed, failed] per candidate)
            u["version"]: (
                u["passed"],
                (g := loop.manifest(u["version"]).gate or {}).get("verdicts", {}).get(EP, {}).get("failed"),
                g.get("step_scale"),
                [[t["step_scale"], t["passed"], t["failed"]] for t in g.get("line_search") or []],
            )
            for u in bad
        }
        prompts, seeds = s.next_prompts(2 * args.kto_batch)  # users keep chatting
        after = s.chats(prompts, seeds)
        requests = {v["version"]: v["requests"] for v in loop.stats()["versions"]}
        served_bad = sum(requests.get(n, 0) for n in bad_names) + sum(s.fingerprints.get(n, 0) for n in bad_names)
        print(
            f"\n(d1) bad version(s) {bad_names}: gate verdicts {verdicts}; serving {loop.served()} (was {good}); "
            f"requests served by the bad version(s): {served_bad} (gateway statistics {requests})",
            flush=True,
        )
        out["bad"] = {
            "versions": bad_names,
            "verdicts": {k: list(v) for k, v in verdicts.items()},
            "requests_served": served_bad,
            "serving_after": loop.served(),
            "serving_before": good,
            "stats_requests": requests,
            "chats_after": len(after),
        }
        # 2. a version that passes the gate but users dislike. The trainer pauses while the serving version (the
        # predecessor) collects its ratings; then it trains them as one batch (max_batch 32) into the next version.
        pred, disliked = loop.served(), None
        for attempt in range(3):
            loop.paused.set()
            n_rate = args.d_predecessor_ratings if attempt == 0 else args.kto_batch
            prompts, seeds = s.next_prompts(n_rate)
            outs = s.chats(prompts, seeds)
            before = set(loop.written)
            post_ratings(
                s.client,
                s.fb_url,
                [(o["id"], liked(o["choices"][0]["message"]["content"], args.max_words), "user") for o in outs],
                s.pool,
            )
            rated = time.perf_counter()
            loop.paused.clear()
            loop.drain(rated)
            ups = loop.settle(before)
            s.updates += [
                {"version": u["version"], "passed": u["passed"], "rating_to_served_s": u.get("served", rated) - rated}
                for u in ups
            ]
            for u in ups:
                gate = loop.manifest(u["version"]).gate or {}
                print(
                    f"  [d] {u['version']} trained on {n_rate} ratings of {pred}: "
                    + ("passed" if u["passed"] else f"REJECTED {gate.get('verdicts', {}).get(EP, {}).get('failed')}"),
                    flush=True,
                )
            if ups and ups[-1]["passed"] and loop.served() == ups[-1]["version"]:
                disliked = ups[-1]["version"]
                break
        loop.paused.set()  # the trainer waits: the version under test keeps serving
        if disliked is None:
            raise RuntimeError("no version passed the gate to test the rollback with")
        pred_stats = {v["version"]: v for v in loop.stats()["versions"]}.get(
            loop.server.services.registry.predecessor.get(EP) or "base", {}
        )
        rng = random.Random(args.seed + 1)
        n, llr, trace = 0, None, []
        while loop.served() == disliked and n < args.d_max_ratings:
            prompts, seeds = s.next_prompts(1)
            o = s.chats(prompts, seeds)[0]
            up = rng.random() < args.d_dislike_up_rate
            post_ratings(s.client, s.fb_url, [(o["id"], up, "user")], s.pool)
            n += 1
            wait_until(lambda: loop.served() != disliked, timeout_s=0.5, interval_s=0.01)
            v = {x["version"]: x for x in loop.stats()["versions"]}.get(disliked, {})
            trace.append({"n": n, "up": up, "thumbs_up": v.get("thumbs_up"), "ratings": v.get("ratings")})
        rolled = loop.served() != disliked
        hist = loop.history("auto_rollback")
        if hist:
            llr = (hist[-1].get("details") or {}).get("llr")
        print(
            f"(d2) {disliked} passed the gate and served; predecessor {pred} had "
            f"{pred_stats.get('thumbs_up')}/{pred_stats.get('ratings')} thumbs up; users then liked each of its "
            f"replies with probability {args.d_dislike_up_rate:.0%}: "
            + (
                f"rolled back to {loop.served()} after N = {n} ratings (LLR {llr:.2f})"
                if rolled and llr is not None
                else f"rolled back after N = {n} ratings"
                if rolled
                else f"NOT rolled back within {n} ratings"
            ),
            flush=True,
        )
        out["dislike"] = {
            "version": disliked,
            "predecessor": pred,
            "predecessor_stats": pred_stats,
            "rolled_back": rolled,
            "ratings_to_rollback": n if rolled else None,
            "llr": llr,
            "trace": trace,
            "serving_after": loop.served(),
            "up_rate": args.d_dislike_up_rate,
        }
        loop.paused.clear()
    finally:
        s.close()
    out["updates"], out["total_s"], out["load"] = s.updates, time.perf_counter() - t0, load_line()
    print(load_line())
    plot_d(out, Path(args.plot).with_name("live_loop_d.png"))
    return out


BAD_REPLY = "The answer to this question."


def plot_curves(
    out: dict, runs: list[dict], path: Path, title: str, *, probes: bool = False, weights: list[dict] | None = None
) -> None:
    """Liked share per run (and probe accuracy, and rater weights when given) as a PNG at ``path``; the
    figures as JSON next to it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str))  # figures first
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    panels = 1 + bool(probes) + bool(weights)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    for r in runs:
        ax.plot([c["events"] for c in r["curve"]], [100 * c["liked"] for c in r["curve"]], marker="o", label=r["label"])
    ax.set_xlabel("feedback events")
    ax.set_ylabel("liked share on held-out prompts (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    i = 1
    if probes:
        ax = axes[0][i]
        i += 1
        for r in runs:
            ax.plot(
                [c["events"] for c in r["curve"]],
                [100 * c["probe_accuracy"] for c in r["curve"]],
                marker="o",
                label=r["label"],
            )
        base = 100 * out["probe_base"]
        ax.axhspan(base - 5, base + 5, color="green", alpha=0.1, label="base ± 5 points")
        ax.set_xlabel("feedback events")
        ax.set_ylabel("capability-probe accuracy of the served version (%)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if weights:
        ax = axes[0][i]
        raters = sorted({k for w in weights for k in w if k != "events"})
        for rater in raters:
            ax.plot([w["events"] for w in weights], [w.get(rater, 1.0) for w in weights], marker=".", label=rater)
        ax.set_xlabel("feedback events")
        ax.set_ylabel("rater agreement weight")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}  figures: {path.with_suffix('.json')}")


def plot_d(out: dict, path: Path) -> None:
    """Scenario (d): the disliked version's thumbs-up count per rating until the rollback."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str))  # figures first
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    d = out.get("dislike") or {}
    trace = d.get("trace") or []
    ax.step(
        [t["n"] for t in trace],
        [t["n"] - (t["thumbs_up"] or 0) for t in trace],
        where="post",
        label=f"thumbs down of {d.get('version')}",
    )
    ax.step([t["n"] for t in trace], [t["thumbs_up"] or 0 for t in trace], where="post", label="thumbs up")
    if d.get("rolled_back"):
        ax.axvline(
            d["ratings_to_rollback"], color="red", ls="--", label=f"rolled back (N = {d['ratings_to_rollback']})"
        )
    b = out.get("bad") or {}
    verdict = "rejected" if not any(v[0] for v in (b.get("verdicts") or {}).values()) else "NOT all rejected"
    fate = (
        f"rolled back after N = {d.get('ratings_to_rollback')} ratings" if d.get("rolled_back") else "NOT rolled back"
    )
    ax.set_title(
        f"(d) bad version {b.get('versions')} {verdict}, served {b.get('requests_served')} requests;\n"
        f"disliked {d.get('version')} {fate}",
        fontsize=8,
    )
    ax.set_xlabel("ratings of the disliked version")
    ax.set_ylabel("count")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}  figures: {path.with_suffix('.json')}")


def taste_run(args) -> dict:
    """The taste run of earlier rounds (rails off): the curve and per-update times, plotted."""
    r = taste(args, rails=False, label="taste")
    c = r["curve"]
    print("\ncurve (feedback events -> liked share on held-out prompts):")
    for p in c:
        print(f"  {p['events']:4d}  {p['liked']:6.1%}  (median {p['median_words']:.1f} words, {p['version']})")
    print(
        f"liked share: {c[0]['liked']:.1%} at 0 events -> {c[-1]['liked']:.1%} at {c[-1]['events']} "
        f"(best {r['gain_pp']:+.1f} pp)"
    )
    print_update(r)
    print(f"total time {r['total_s']:.0f} s; {load_line()}")
    plot_curves({"scenario": "taste", "run": r}, [r], Path(args.plot), "taste run (rails off)")
    return r


def latency_run(args) -> None:
    from harness.server import wait_until

    loop = Loop(args, kto_min_batch=args.requests, max_batch=max(2, args.requests))
    try:
        chat_s, fb_s, ids = [], [], []
        client = httpx.Client(timeout=600)
        for i in range(args.requests):
            t0 = time.perf_counter()
            ids.append(
                chat(
                    client,
                    loop.server.url("/v1/chat/completions"),
                    f"Give me fact number {i} about the sea.",
                    max_tokens=args.max_tokens,
                    temperature=0,
                    seed=0,
                )["id"]
            )
            chat_s.append(time.perf_counter() - t0)
        for i, cid in enumerate(ids):
            t0 = time.perf_counter()
            r = client.post(loop.server.url("/v1/feedback"), json={"completion_id": cid, "rating": i % 2 == 0})
            fb_s.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        rated = time.perf_counter()
        name = f"{EP}@1"
        ok = wait_until(lambda: loop.served() == name, timeout_s=1800, interval_s=0.01)
        served = time.perf_counter()
        print(f"requests={args.requests} max_tokens={args.max_tokens} store={loop.home}")
        print(f"chat latency median={statistics.median(chat_s):.3f} s (includes the completion-log write)")
        print(f"feedback accept latency median={statistics.median(fb_s) * 1000:.1f} ms max={max(fb_s) * 1000:.1f} ms")
        if ok and name in loop.written:
            print(
                f"last rating -> {name} written: {loop.written[name] - rated:.2f} s; written -> served: "
                f"{served - loop.written[name]:.2f} s; total {served - rated:.2f} s"
            )
        else:
            print(f"{name} was not served within the time limit")
        client.close()
    finally:
        loop.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--scenario",
        choices=["a", "b", "c", "d"],
        default=None,
        help="one of the rails scenarios (module docstring); default: the plain taste run",
    )
    ap.add_argument("--latency", action="store_true", help="only the rating -> served latency measurement")
    ap.add_argument("--requests", type=int, default=4, help="--latency: completions rated (one KTO batch)")
    ap.add_argument("--max-tokens", type=int, default=None, help="reply length cap (taste run 40, latency run 8)")
    ap.add_argument("--temperature", type=float, default=0.7, help="serving temperature of chats and evaluations")
    ap.add_argument("--max-words", type=int, default=20, help="the user likes replies of at most this many words")
    ap.add_argument("--events", type=int, default=None, help="feedback events (taste, a, b: 200; c: 300)")
    ap.add_argument("--eval-every", type=int, default=40, help="evaluate after every this many events")
    ap.add_argument("--eval-rounds", type=int, default=2, help="(c) evaluate after every this many rounds")
    ap.add_argument("--eval-samples", type=int, default=2, help="seeded samples per held-out prompt")
    ap.add_argument("--kto-batch", type=int, default=None, help="ratings per KTO step (default: trainer's)")
    ap.add_argument("--kto-lr", type=float, default=None, help="KTO learning rate (default: trainer's)")
    ap.add_argument("--beta", type=float, default=None, help="KTO beta (default: trainer's)")
    ap.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default: trainer's)")
    ap.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: trainer's)")
    ap.add_argument(
        "--rater-max-events",
        type=int,
        default=None,
        help="rails on: events per rater and hour before quarantine (default: trainer's)",
    )
    ap.add_argument("--rails-off", action="store_true", help="(c) run without the rails, for comparison")
    ap.add_argument("--arms", default="off,on", help="(b) which runs: off, on or both (off,on)")
    ap.add_argument(
        "--b-rails-on-from",
        default=None,
        help="(b) take the rails-on run from scenario (a)'s JSON instead of running it again",
    )
    ap.add_argument("--d-warmup-rounds", type=int, default=3, help="(d) honest rounds before the bad version")
    ap.add_argument(
        "--d-predecessor-ratings",
        type=int,
        default=24,
        help="(d) ratings the predecessor collects before the disliked version (rollback needs 20)",
    )
    ap.add_argument(
        "--d-dislike-up-rate",
        type=float,
        default=0.2,
        help="(d) chance that a user likes a reply of the disliked version",
    )
    ap.add_argument(
        "--d-bad-lr",
        type=float,
        default=1e-2,
        help="(d) SFT learning rate of the bad version (the default SFT rate is 1e-4)",
    )
    ap.add_argument("--d-max-ratings", type=int, default=60, help="(d) most ratings of the disliked version")
    ap.add_argument("--max-batch-size", type=int, default=16, help="engine decode batch")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt order and chat seeds")
    ap.add_argument("--keep-store", action="store_true", help="keep the temporary store (adapters, dataset)")
    ap.add_argument(
        "--plot",
        default=str(Path(__file__).resolve().parent / "out" / "live_loop.png"),
        help="PNG of the taste run; scenario X writes live_loop_X.png in the same folder",
    )
    a = ap.parse_args()
    from livelora.trainer.settings import TrainingSection

    if a.kto_batch is None:
        a.kto_batch = TrainingSection.model_fields["kto_min_batch"].default
    if a.rater_max_events is None:
        a.rater_max_events = TrainingSection.model_fields["rater_max_events"].default
    if a.events is None:
        a.events = 300 if a.scenario == "c" else 200
    if a.latency:
        a.max_tokens = a.max_tokens or 8
        latency_run(a)
    else:
        a.max_tokens = a.max_tokens or 40
        {"a": scenario_a, "b": scenario_b, "c": scenario_c, "d": scenario_d, None: taste_run}[a.scenario](a)
