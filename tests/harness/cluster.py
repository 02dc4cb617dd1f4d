"""Real livelora processes for tests and ``bench/soak.py``: N ``livelora gateway`` and M ``livelora trainer``
subprocesses (the CLI, not threads) on one Redis prefix and one store, plus the checks of the store that
count signals and versions.

Example::

    cluster = Cluster(home, prefix, env={"LIVELORA_LEASE_TTL_S": "2"})
    cluster.start(gateways=2, trainers=2)
    httpx.get(cluster.gateways[0].url + "/health")
    cluster.kill(cluster.trainers[0])      # SIGKILL
    cluster.stop()
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_store(root: Path, models_from: Path) -> Path:
    """A fresh store whose ``models/`` is a link to an existing store's converted base models."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "models").exists():
        (root / "models").symlink_to(Path(models_from) / "models", target_is_directory=True)
    return root


@dataclass
class Proc:
    """One livelora process: ``kind`` gateway|trainer, its index, port (gateways), Popen and log file."""

    kind: str
    index: int
    args: list[str]
    env: dict[str, str]
    log: Path
    port: int | None = None
    popen: subprocess.Popen | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> None:
        self.starts += 1
        out = open(self.log, "ab")
        out.write(f"\n===== start {self.starts} =====\n".encode())
        out.flush()
        self.popen = subprocess.Popen(
            self.args, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.is_file() else ""


@dataclass
class Cluster:
    """Gateways and trainers of one install (store ``home`` + Redis ``prefix``)."""

    home: Path
    prefix: str
    env: dict[str, str] = field(default_factory=dict)
    redis_url: str = "redis://127.0.0.1:6379/0"
    gateways: list[Proc] = field(default_factory=list)
    trainers: list[Proc] = field(default_factory=list)

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "LIVELORA_HOME": str(self.home),
            "LIVELORA_REDIS_PREFIX": self.prefix,
            "LIVELORA_REDIS_URL": self.redis_url,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }

    def add_gateway(self) -> Proc:
        i, port = len(self.gateways), free_port()
        proc = Proc(
            "gateway",
            i,
            [sys.executable, "-m", "livelora.cli.main", "gateway", "--port", str(port), "--log-level", "warning"],
            self._env(),
            self.home / f"gateway-{i}.log",
            port,
        )
        self.gateways.append(proc)
        proc.start()
        return proc

    def add_trainer(self, nproc: int = 1) -> Proc:
        """A ``livelora trainer`` (``nproc`` > 1: a trainer group of that many ranks under torchrun)."""
        i = len(self.trainers)
        env = {**self._env(), "LIVELORA_CONSUMER": f"trainer-{i}"}
        args = [sys.executable, "-m", "livelora.cli.main", "trainer", *(["--nproc", str(nproc)] if nproc > 1 else [])]
        proc = Proc("trainer", i, args, env, self.home / f"trainer-{i}.log")
        self.trainers.append(proc)
        proc.start()
        return proc

    def start(self, gateways: int, trainers: int, timeout_s: float = 600.0) -> None:
        """Start the processes and wait until every gateway answers /health and every trainer consumes."""
        for _ in range(gateways):
            self.add_gateway()
        for _ in range(trainers):
            self.add_trainer()
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 600.0, procs: list[Proc] | None = None) -> None:
        """Raises RuntimeError (with the process's log tail) if one dies or is not ready in time."""
        deadline = time.monotonic() + timeout_s
        for proc in procs or [*self.gateways, *self.trainers]:
            while not self.ready(proc):
                if not proc.alive():
                    raise RuntimeError(f"{proc.kind} {proc.index} exited ({proc.popen.returncode}):\n{proc.tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.kind} {proc.index} not ready in {timeout_s} s:\n{proc.tail()}")
                time.sleep(0.3)

    def ready(self, proc: Proc) -> bool:
        if proc.kind == "gateway":
            try:
                return httpx.get(proc.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        return "signal worker consuming" in proc.tail(100_000).split(f"===== start {proc.starts} =====")[-1]

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        if proc.alive():
            os.killpg(proc.pid, sig)
            proc.popen.wait(timeout=60)

    def restart(self, proc: Proc) -> None:
        self.kill(proc)
        proc.start()

    def stop(self) -> None:
        """SIGTERM every process (SIGKILL after 30 s)."""
        procs = [p for p in [*self.gateways, *self.trainers] if p.alive()]
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.popen.wait()

    def ranks(self, proc: Proc) -> dict[int, int]:
        """``{rank: pid}`` of a trainer group's ranks (the launcher's children with ``RANK`` set; Linux ``/proc``)."""
        out = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != proc.pid:
                    continue
                env = dict(kv.split("=", 1) for kv in (stat.parent / "environ").read_text().split("\0") if "=" in kv)
            except (OSError, ValueError, IndexError):
                continue
            if "RANK" in env:
                out[int(env["RANK"])] = int(stat.parent.name)
        return out

    def owner_of(self, model_id: str) -> Proc | None:
        """The trainer whose executor holds the model's lease (None: nobody)."""
        r = redis.Redis.from_url(self.redis_url, decode_responses=True)
        try:
            value = r.get(f"{self.prefix}lease:model:{model_id}")
        finally:
            r.close()
        if value is None:
            return None
        pid = int(value.split(":", 1)[1].rsplit("-", 2)[1])
        return next((p for p in self.trainers if p.alive() and pid in (p.pid, self.ranks(p).get(0))), None)


# ------------------------------------------------------------------------------------------- store checks
@contextmanager
def cluster_on_new_store(
    models_from: Path, tmp_path_factory, name: str, env: dict[str, str], redis_url: str
) -> Iterator[Cluster]:
    """A :class:`Cluster` (nothing started) on a fresh store (base models linked from ``models_from``) and a
    Redis prefix of its own under the test run's; every process it started is stopped on exit."""
    home = new_store(tmp_path_factory.mktemp(f"{name}-home"), models_from)
    c = Cluster(home, f"{os.environ['LIVELORA_REDIS_PREFIX']}{name}-{uuid.uuid4().hex[:8]}:", env, redis_url)
    try:
        yield c
    finally:
        c.stop()


def trained_counts(home: Path) -> dict[str, int]:
    """Event id → how many versions were trained on it (``trained.jsonl``)."""
    path = Path(home) / "data" / "signals" / "trained.jsonl"
    counts: dict[str, int] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                for eid in json.loads(line)["event_ids"]:
                    counts[eid] = counts.get(eid, 0) + 1
            except (json.JSONDecodeError, KeyError):
                continue
    return counts


def recorded_counts(home: Path) -> dict[str, int]:
    """Event id → lines in the dataset of record."""
    counts: dict[str, int] = {}
    for path in sorted((Path(home) / "data" / "signals").glob("[0-9]*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec.get("event"), dict):
                counts[rec["event"]["id"]] = counts.get(rec["event"]["id"], 0) + 1
    return counts


def corrupt_versions(home: Path) -> tuple[int, list[str]]:
    """``(versions checked, names whose weights do not match their manifest's sha256)``."""
    from livelora.adapters.store import AdapterStore

    store = AdapterStore(home)
    checked, bad = 0, []
    for lineage in store.lineages():
        for m in store.list(lineage):
            checked += 1
            if not store.verify(lineage, m.version):
                bad.append(m.name)
    return checked, bad
