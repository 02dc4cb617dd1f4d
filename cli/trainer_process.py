"""``livelora serve``'s trainer in its own process: serving first.

:class:`TrainerProcess` runs the trainer (signal worker + op executor, :func:`~livelora.cli.processes.run_trainer`)
as a child process that ``livelora serve`` starts and supervises: the child lowers its CPU priority by
``trainer_nice`` and uses its own torch thread budget (``trainer_threads``, default half the cores:
:func:`default_trainer_threads`); a child that exits unexpectedly is restarted with back-off under the same
consumer name, and it gets SIGTERM when the parent dies. Why the trainer is not a thread of the gateway:
``docs/internals/core-sharing.md``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
from typing import Any

log = logging.getLogger(__name__)


def available_cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_trainer_threads(cores: int | None = None) -> int:
    """Torch threads of the trainer process when ``LIVELORA_TRAINER_THREADS`` is unset: half the cores (at least
    one), leaving the rest to the engine. ``cores`` defaults to the CPUs this process may run on."""
    return max(1, (available_cores() if cores is None else cores) // 2)


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM to this process when its parent dies (Linux); exit at once if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(0)


def _trainer_main(
    settings: Any, nice: int, threads: int, parent_pid: int, log_level: int, idle_threads: int = 0, duty: float = 1.0
) -> None:
    """Entry point of the child process (spawned): priority, threads, logging, then
    :func:`~livelora.cli.processes.run_trainer` until SIGTERM/SIGINT."""
    _die_with_parent(parent_pid)
    if nice:
        os.nice(nice)
    import torch

    torch.set_num_threads(threads)
    if idle_threads or duty < 1.0:  # steps while nothing is served take every core; the duty while serving
        from livelora.core.cpu_share import configure_training_steps

        configure_training_steps(settings.home, busy=threads, idle=idle_threads or threads, duty=duty)
    if getattr(getattr(settings, "observability", None), "log_format", "text") == "json":
        from livelora.core.logs import configure_logging

        configure_logging("json", log_level)  # LIVELORA_LOG_FORMAT=json: the trainer's lines too
    else:
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s trainer %(name)s: %(message)s")
    from livelora.cli.processes import run_trainer

    run_trainer(settings)


class TrainerProcess:
    """Start, supervise and stop ``livelora serve``'s trainer process.

    Args:
        settings: the child's :class:`~livelora.trainer.settings.TrainerSettings` (pickled to it; it does not
            re-read the environment). A missing ``training.consumer`` is fixed to ``<host>-serve-<pid>`` so a
            restarted child resumes the pending signals of the one before it.
        nice: added to the child's nice value (0-19). threads: the child's torch threads (>= 1).
        idle_threads: torch threads of a step that starts while no request is being served on this machine
            (:func:`~livelora.core.cpu_share.configure_training_steps`; 0: always ``threads``).
        duty: largest share of wall time in training steps while requests are served (1: never pauses;
            :class:`~livelora.core.cpu_share.StepPacer`).
        log_level: the child's logging level.

    Example::

        trainer = TrainerProcess(settings.trainer_settings(), nice=10, threads=1)
        trainer.start()
        ...
        trainer.stop()
    """

    #: seconds before the first restart of a child that died; doubles up to :attr:`MAX_BACKOFF_S`
    BACKOFF_S = 1.0
    MAX_BACKOFF_S = 30.0

    def __init__(
        self,
        settings: Any,
        *,
        nice: int,
        threads: int,
        idle_threads: int = 0,
        duty: float = 1.0,
        log_level: int = logging.INFO,
    ):
        if settings.training.consumer is None:
            training = settings.training.model_copy(update={"consumer": f"{socket.gethostname()}-serve-{os.getpid()}"})
            settings = settings.model_copy(update={"training": training})
        self.settings, self.nice, self.threads, self.log_level = settings, nice, threads, log_level
        self.idle_threads, self.duty = idle_threads, duty
        self._ctx = multiprocessing.get_context("spawn")  # never fork a process with torch and server threads
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.process: Any = None
        self.restarts = 0
        self._watcher: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The running child's pid (``None`` before start or between restarts)."""
        proc = self.process
        return proc.pid if proc is not None and proc.is_alive() else None

    def _spawn(self) -> None:
        proc = self._ctx.Process(
            target=_trainer_main,
            name="livelora-trainer",
            args=(self.settings, self.nice, self.threads, os.getpid(), self.log_level, self.idle_threads, self.duty),
        )
        proc.start()
        self.process = proc
        log.info(
            "trainer process %d started (nice +%d, %d torch threads, %s while nothing is served)",
            proc.pid,
            self.nice,
            self.threads,
            self.idle_threads or self.threads,
        )

    def start(self) -> None:
        """Spawn the child and the thread that restarts it when it dies."""
        with self._lock:
            self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="livelora-trainer-supervisor", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        backoff = self.BACKOFF_S
        while not self._stopping.is_set():
            proc = self.process
            proc.join(timeout=0.5)
            if proc.is_alive() or self._stopping.is_set():
                continue
            log.error("trainer process %d exited with %s; restarting in %.0f s", proc.pid, proc.exitcode, backoff)
            _forget_metrics_of(proc.pid)
            if self._stopping.wait(backoff):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                self._spawn()
                self.restarts += 1
            backoff = min(self.MAX_BACKOFF_S, backoff * 2)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the child (it finishes its current op or step and gives its leases back), wait up to
        ``timeout_s`` seconds, then SIGKILL it."""
        self._stopping.set()
        with self._lock:
            proc = self.process
        if proc is None:
            return
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout_s)
        if proc.is_alive():
            log.warning("trainer process %d did not stop within %.0f s: killed", proc.pid, timeout_s)
            proc.kill()
            proc.join(5)
        if self._watcher is not None:
            self._watcher.join(2)


def _forget_metrics_of(pid: int) -> None:
    """With ``PROMETHEUS_MULTIPROC_DIR`` (``livelora serve`` sets one up), drop a dead child's live gauges from the
    aggregate (prometheus-client's ``mark_process_dead``); its counters stay counted."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def run_group(settings: Any) -> int:
    """One rank of a trainer group (``livelora trainer --nproc N``, or ``torchrun ... -m
    livelora.cli.trainer_process``; ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` from the launcher).
    Rank 0 runs the trainer (:func:`~livelora.cli.processes.run_trainer`) with every training model on the group;
    the other ranks mirror its models (:mod:`livelora.trainer.group_mirror`) and touch neither Redis nor the store.
    Returns the exit status: 0 after a clean stop, 3 when the group failed (a rank died or hung)."""
    from livelora.trainer.distributed import GroupFailedError, TrainerGroup
    from livelora.trainer.group_mirror import GroupLeader, follow

    g = settings.group
    device = settings.training.device
    group = TrainerGroup.join(
        backend=g.group_backend,
        timeout_s=g.group_timeout_s,
        device=device,
        current=True,
        shard_base=g.group_shard_base,
    )
    log.info("trainer group rank %d of %d (%s), pid %d", group.rank, group.world_size, group.backend, os.getpid())
    if not group.leader:
        signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: rank %d ends when rank 0 does", group.rank))
        signal.signal(signal.SIGINT, signal.SIG_IGN)

        def build(state: dict[str, Any], spec: dict[str, Any]) -> Any:
            from livelora.core.base_models import resolve_base_model
            from livelora.trainer.recovery import restore_model

            base = resolve_base_model(settings.model, settings.home)
            return restore_model(state, base, device=device, max_seq_len=spec["max_seq_len"])

        try:
            follow(group, build)
        except GroupFailedError as exc:
            log.error("rank %d stops: %s", group.rank, exc)
            return 3
        group.close()
        return 0
    from livelora.cli.processes import run_trainer

    stop = threading.Event()
    leader = GroupLeader(group, stop.set, heartbeat_s=g.group_timeout_s / 4)
    leader.start()
    try:
        run_trainer(settings, stop)
    finally:
        leader.close()
    if leader.failed:
        return 3
    group.close()
    return 0


def main() -> None:
    """``python -m livelora.cli.trainer_process`` under a launcher: one rank of a trainer group, its settings from
    the environment (``LIVELORA_*``)."""
    from livelora.trainer.settings import TrainerSettings

    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    sys.exit(run_group(TrainerSettings()))


if __name__ == "__main__":
    main()
