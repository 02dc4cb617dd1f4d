"""Soak: N ``livelora gateway`` × M ``livelora trainer`` processes on one Redis prefix and one store for a bounded
time, with streamed chat completions, ratings and a training session, while a random process is killed
(SIGKILL) every K seconds (a bounded number of times) and restarted.

It prints requests served and failed (and how many failures a kill explains: the gateway serving them was
killed while they ran), session ops done / failed clearly (``trainer_lost``) / failed otherwise, session ops
stalled (no result within ``--op-timeout-s``, model creation included, each with the model's server-side state:
lease, highest committed seq, the ops left in its stream and their futures), signals accepted / recorded /
trained / held out by the gate (one rating in ``gate_holdout_every``, never trained) / lost / duplicated, corrupt
versions (sha256 against the manifest) and Redis memory at the end. Figures only: nothing is asserted.

    nice -n 10 python bench/soak.py --gateways 2 --trainers 2 --duration 300 --kill-every 45 --max-kills 5

Needs Redis (``--redis-url``) and the built-in model converted in ``LIVELORA_HOME`` (``--models-from``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from harness.cluster import MODEL, Cluster, Proc, corrupt_versions, new_store, recorded_counts, trained_counts  # noqa: E402

TOPICS = ["the sea", "a cat", "rain", "bread", "a bicycle", "winter", "a library", "coffee", "mountains", "music"]


@dataclass
class Stats:
    lock: threading.Lock = field(default_factory=threading.Lock)
    served: int = 0
    failed: list[tuple[str, float, float, str]] = field(default_factory=list)  # (gateway, start, end, why)
    accepted: list[str] = field(default_factory=list)
    ops_done: int = 0
    ops_lost: int = 0  # failed clearly: trainer_lost
    ops_failed: list[str] = field(default_factory=list)
    stalled: list[str] = field(default_factory=list)  # ops with no result within --op-timeout-s, and why
    sessions: int = 0
    kills: list[tuple[str, float, float]] = field(default_factory=list)  # (process, killed at, ready again at)

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                cur = getattr(self, k)
                if isinstance(cur, list):
                    cur.append(v)
                else:
                    setattr(self, k, cur + v)


class Soak:
    def __init__(self, cluster: Cluster, args: argparse.Namespace):
        self.c = cluster
        self.args = args
        self.stats = Stats()
        self.stop = threading.Event()
        self.down: set[str] = set()  # names of processes killed and not ready again
        self.rng = random.Random(args.seed)
        self.phase = "start"

    @staticmethod
    def name(p: Proc) -> str:
        return f"{p.kind}-{p.index}"

    def live_gateways(self) -> list[Proc]:
        return [g for g in self.c.gateways if self.name(g) not in self.down and g.alive()]

    # ---------------------------------------------------------------- workload
    def chat_loop(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            gws = self.live_gateways()
            if not gws:
                time.sleep(0.2)
                continue
            g = rng.choice(gws)
            t0 = time.time()
            try:
                cid, done = None, False
                with httpx.stream(
                    "POST",
                    g.url + "/v1/chat/completions",
                    timeout=120,
                    json={
                        "model": MODEL,
                        "stream": True,
                        "max_tokens": self.args.max_tokens,
                        "temperature": 0.8,
                        "messages": [{"role": "user", "content": f"Tell me about {rng.choice(TOPICS)}."}],
                    },
                ) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}")
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                raise RuntimeError(chunk["error"].get("message", "error event"))
                            cid = cid or chunk.get("id")
                        elif line == "data: [DONE]":
                            done = True
                if not done or cid is None:
                    raise RuntimeError("stream ended without [DONE]")
                self.stats.add(served=1)
            except Exception as exc:
                self.stats.add(failed=(self.name(g), t0, time.time(), f"chat: {type(exc).__name__}: {exc}"[:200]))
                continue
            gws = self.live_gateways()
            if not gws:
                continue
            g2, t1 = rng.choice(gws), time.time()
            try:
                r = httpx.post(
                    g2.url + "/v1/feedback",
                    timeout=30,
                    json={"completion_id": cid, "rating": rng.random() < 0.5, "user": f"u{seed}"},
                )
                if r.status_code >= 300:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:100]}")
                self.stats.add(served=1, accepted=r.json()["id"])
            except Exception as exc:
                self.stats.add(failed=(self.name(g2), t1, time.time(), f"feedback: {type(exc).__name__}: {exc}"[:200]))

    def diagnose(self, model_id: str | None) -> str:
        """A model's server-side state: lease holder, highest committed seq, the ops left in its stream with their
        futures' states."""
        if model_id is None:
            return "no model yet"
        p = self.c.prefix
        r = redis.Redis.from_url(self.c.redis_url, decode_responses=True)
        try:
            left = []
            for _, f in r.xrange(f"{p}ops:{model_id}"):
                op = json.loads(f["op"])
                state = json.loads(r.get(f"{p}future:{op['request_id']}") or '{"state": "missing"}')["state"]
                left.append(f"{op['seq_id']}:{op['kind']}:{state}")
            alive = bool(r.exists(f"{p}session:" + model_id.split(":train:")[0]))
            return (
                f"lease {r.get(f'{p}lease:model:{model_id}')}, applied {r.hget(f'{p}opruns:{model_id}', 'applied')}, "
                f"session alive {alive}, stream [{', '.join(left)}]"
            )
        finally:
            r.close()

    def session_loop(self, tokenizer) -> None:
        from livelora.clients import AdamParams, ServiceClient
        from livelora.clients.errors import LiveloraError
        from livelora.clients.futures import APIFuture
        from livelora.clients.types.tinker import Datum, ModelInput, SamplingParams, TensorData

        def datum(text: str) -> Datum:
            ids = tokenizer.encode(text)
            return Datum(
                model_input=ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": TensorData.from_list(ids[1:], "int64"),
                    "weights": TensorData.from_list([1.0] * (len(ids) - 1), "float32"),
                },
            )

        while not self.stop.is_set():
            gws = self.live_gateways()
            if not gws:
                time.sleep(0.5)
                continue
            g = self.rng.choice(gws)
            t0, service, model_id = time.time(), None, None
            try:
                service = ServiceClient(g.url)
                self.phase = f"create_model on {self.name(g)}"
                training = APIFuture.from_callable(
                    lambda s=service: s.create_lora_training_client(base_model=MODEL, rank=2)
                ).result(timeout=self.args.op_timeout_s)
                model_id = training.model_id
                self.stats.add(sessions=1, ops_done=1)
                n = 0
                while not self.stop.is_set():
                    data = [datum(f"Fact {n}.{i}: {self.rng.choice(TOPICS)} is worth a thought.") for i in range(4)]
                    t0 = time.time()
                    self.phase = f"forward_backward/optim_step {n}"
                    fb = training.forward_backward(data, "cross_entropy")
                    opt = training.optim_step(AdamParams(learning_rate=1e-4))
                    try:
                        fb.result(timeout=self.args.op_timeout_s)
                        self.stats.add(ops_done=1)
                        opt.result(timeout=self.args.op_timeout_s)
                        self.stats.add(ops_done=1)
                    except LiveloraError as exc:
                        if exc.code != "trainer_lost":
                            raise
                        self.stats.add(ops_lost=1)
                    n += 1
                    if n % 5 == 0:
                        t0 = time.time()
                        self.phase = f"save_weights_for_sampler {n}"
                        path = training.save_weights_for_sampler(f"s{n}").result(timeout=self.args.op_timeout_s).path
                        self.stats.add(ops_done=1)
                        other = self.rng.choice(self.live_gateways() or [g])
                        self.phase = f"sample {n} on {self.name(other)}"
                        with ServiceClient(other.url) as sampling_service:  # closed: its adapter is unloaded
                            sampler = sampling_service.create_sampling_client(model_path=path)
                            sampler.sample(
                                ModelInput.from_ints(tokenizer.encode("Coffee is")), 1, SamplingParams(max_tokens=4)
                            ).result(timeout=self.args.op_timeout_s)
                        self.stats.add(served=1)
            except Exception as exc:
                if isinstance(exc, TimeoutError):
                    t = time.time() - self.t0
                    self.stats.add(stalled=f"@{t:.0f}s {self.phase}: {self.diagnose(model_id)}"[:400])
                self.stats.add(
                    failed=(
                        self.name(g),
                        t0,
                        time.time(),
                        f"session ({self.phase}): {type(exc).__name__}: {exc}"[:200],
                    ),
                    ops_failed=f"{type(exc).__name__}: {exc}"[:200],
                )
                if service is not None:
                    with contextlib.suppress(Exception):
                        service.close("errored")
                time.sleep(1)

    # ---------------------------------------------------------------- chaos
    def killer(self) -> None:
        kills = 0
        while kills < self.args.max_kills and not self.stop.wait(self.args.kill_every):
            victim = self.rng.choice([*self.c.gateways, *self.c.trainers])
            name = self.name(victim)
            self.down.add(name)
            t_kill = time.time()
            self.c.kill(victim)
            print(f"[{t_kill - self.t0:6.1f} s] SIGKILL {name}", flush=True)
            victim.start()
            try:
                self.c.wait_ready(600, [victim])
            except RuntimeError as exc:
                print(f"restart of {name} failed: {exc}", flush=True)
            t_ready = time.time()
            self.down.discard(name)
            self.stats.add(kills=(name, t_kill, t_ready))
            print(f"[{t_ready - self.t0:6.1f} s] {name} ready again ({t_ready - t_kill:.1f} s)", flush=True)
            kills += 1

    def cut_by_kill(self, gateway: str, start: float, end: float) -> bool:
        """Whether ``gateway`` was killed or down (killed, not yet ready again) while the request ran."""
        return any(name == gateway and k - 1 <= end and start <= ready + 1 for name, k, ready in self.stats.kills)

    # ---------------------------------------------------------------- run
    def run(self, tokenizer) -> dict:
        self.t0 = time.time()
        threads = [threading.Thread(target=self.chat_loop, args=(i,), daemon=True) for i in range(self.args.clients)]
        threads += [
            threading.Thread(target=self.session_loop, args=(tokenizer,), daemon=True)
            for _ in range(self.args.sessions)
        ]
        killer = threading.Thread(target=self.killer, daemon=True)
        for t in [*threads, killer]:
            t.start()
        self.stop.wait(self.args.duration)
        self.stop.set()
        self.phase_at_stop = self.phase
        killer.join(timeout=900)
        for t in threads:
            t.join(timeout=300)
        load_run = os.getloadavg()
        self.workload_s = time.time() - self.t0
        print(f"[{time.time() - self.t0:6.1f} s] workload stopped; waiting for the trainers to drain", flush=True)
        accepted = set(self.stats.accepted)
        deadline = time.time() + self.args.drain_s
        while time.time() < deadline and not accepted <= set(trained_counts(self.c.home)):
            time.sleep(2)
        return self.report(load_run)

    def report(self, load_run) -> dict:
        s, home = self.stats, self.c.home
        accepted = set(s.accepted)
        trained, recorded = trained_counts(home), recorded_counts(home)
        rejected = home / "data" / "signals" / "rejected.jsonl"
        dead = {json.loads(x)["event_id"] for x in rejected.read_text().splitlines()} if rejected.is_file() else set()
        checked, bad = corrupt_versions(home)
        r = redis.Redis.from_url(self.c.redis_url, decode_responses=True)
        keys = list(r.scan_iter(match=self.c.prefix + "*", count=1000))
        prefix_bytes = sum(int(r.memory_usage(k) or 0) for k in keys)
        info = r.info("memory")
        retrained = int(r.get(self.c.prefix + "signals:retrained") or 0)
        stream_len = r.xlen(self.c.prefix + "signals") if r.exists(self.c.prefix + "signals") else 0
        runs = [r.hgetall(k) for k in keys if k.startswith(self.c.prefix + "opruns:")]
        seqs = [(int(k), int(v)) for h in runs for k, v in h.items() if k != "applied"]
        gaps = 0  # seq ids below a model's highest committed one that were never committed
        for h in runs:
            committed = [int(k) for k in h if k != "applied"]
            gaps += (max(committed) + 1 - len(committed)) if committed else 0
        queued = {json.loads(f["event"])["id"] for _, f in r.xrange(self.c.prefix + "signals")} if stream_len else set()
        r.close()
        from livelora.trainer.gate import held_out
        from livelora.trainer.settings import GateSection

        gate = GateSection()  # the trainers' gate holds one rating in gate_holdout_every out of training, by design
        every = gate.gate_holdout_every if gate.gate_enabled else 0
        held = {e for e in accepted - set(trained) if held_out(e, every)}
        lonely = accepted - set(trained) - dead - held
        lonely = lonely if len(lonely) == 1 and lonely <= queued else set()  # a lone KTO rating waits for a partner
        cut = [f for f in s.failed if self.cut_by_kill(*f[:3])]
        out = {
            "duration_s": self.args.duration,
            "workload_stopped_after_s": round(self.workload_s, 1),
            "gateways": len(self.c.gateways),
            "trainers": len(self.c.trainers),
            "kills": [(n, round(k - self.t0, 1), round(rd - k, 1)) for n, k, rd in s.kills],
            "requests_served": s.served,
            "requests_failed": len(s.failed),
            "failed_cut_by_a_kill": len(cut),
            "failed_other": [f[3] for f in s.failed if f not in cut][:10],
            "failed_cut_by_a_kill_detail": [f"{f[0]} @{f[1] - self.t0:.0f}s: {f[3][:100]}" for f in cut][:10],
            "session_phase_at_stop": self.phase_at_stop,
            "sessions_started": s.sessions,
            "session_ops_done": s.ops_done,
            "session_ops_committed_server_side": len(seqs),
            "session_ops_committed_not_exactly_once": sum(1 for _, v in seqs if v != 1),
            "session_seq_gaps": gaps,
            "session_steps_refused_trainer_lost": s.ops_lost,
            "session_ops_stalled": len(s.stalled),
            "session_stalls": s.stalled[:5],
            "signals_accepted": len(accepted),
            "signals_recorded": len(accepted & set(recorded)),
            "signals_trained": len(accepted & set(trained)),
            "signals_dead_lettered": len(accepted & dead),
            "signals_waiting_alone_for_a_kto_partner": len(lonely),
            "signals_held_out_by_the_gate": len(held),
            "signals_lost": len(accepted - set(trained) - dead - lonely - held),
            "signals_duplicated": (
                sum(1 for v in trained.values() if v > 1) + sum(1 for v in recorded.values() if v > 1)
            ),
            "signals_retrained_counter": retrained,
            "signals_stream_len_at_end": stream_len,
            "versions_checked": checked,
            "corrupt_versions": len(bad),
            "redis_keys_of_prefix": len(keys),
            "redis_bytes_of_prefix": prefix_bytes,
            "redis_used_memory_human": info.get("used_memory_human"),
            "load_average_during_run": [round(x, 2) for x in load_run],
        }
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gateways", type=int, default=2)
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--duration", type=float, default=300, help="seconds of workload")
    ap.add_argument("--kill-every", type=float, default=45, help="seconds between kills")
    ap.add_argument("--max-kills", type=int, default=5)
    ap.add_argument("--clients", type=int, default=2, help="concurrent chat+rating clients")
    ap.add_argument("--sessions", type=int, default=1, help="concurrent training sessions")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--op-timeout-s", type=float, default=120, help="a session op not done by then is a failure")
    ap.add_argument("--drain-s", type=float, default=240, help="wait this long for every signal to be trained")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--redis-url", default=os.environ.get("LIVELORA_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--models-from", type=Path, default=Path(os.environ.get("LIVELORA_HOME", REPO / ".livelora-home")))
    ap.add_argument("--home", type=Path, default=None, help="store of the soak (default: a new temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()

    from livelora.core.base_models import load_tokenizer, resolve_base_model

    home = new_store(args.home or Path(tempfile.mkdtemp(prefix="livelora-soak-")), args.models_from)
    prefix = f"livelora-soak-{uuid.uuid4().hex[:8]}:"
    env = {
        "LIVELORA_LEASE_TTL_S": "3",
        "LIVELORA_CLAIM_IDLE_S": "10",
        "LIVELORA_KTO_MIN_BATCH": "4",
        "LIVELORA_MAX_WAIT_S": "5",
        "LIVELORA_MAX_BATCH_SIZE": "4",
        "LIVELORA_LORA_RANK": "2",
        "LIVELORA_SESSION_TTL_S": "60",
    }
    cluster = Cluster(home, prefix, env, args.redis_url)
    tokenizer = load_tokenizer(resolve_base_model(MODEL, args.models_from))
    print(
        f"store {home}, Redis {args.redis_url} prefix {prefix!r}; starting {args.gateways} gateways and "
        f"{args.trainers} trainers",
        flush=True,
    )
    t = time.time()
    try:
        cluster.start(args.gateways, args.trainers)
        print(f"cluster ready in {time.time() - t:.1f} s", flush=True)
        figures = Soak(cluster, args).run(tokenizer)
    finally:
        cluster.stop()
    figures["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    for k, v in figures.items():
        print(f"{k:38s} {v}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    r = redis.Redis.from_url(args.redis_url)
    for key in r.scan_iter(match=prefix + "*", count=1000):
        r.delete(key)
    r.close()


if __name__ == "__main__":
    main()
