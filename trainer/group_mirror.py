"""A trainer group process: rank 0 runs the trainer, the other ranks mirror its training models.

Rank 0 (:class:`GroupLeader`) is the group's only voice on Redis and in the store; every call of a
:class:`~livelora.trainer.model.TrainingModel` that runs collectives (``forward``, ``forward_backward``,
``optim_step``: :func:`~livelora.trainer.distributed.mirrored`) is first broadcast to the other ranks, with the
model's whole state when it changed since the ranks last saw it (created, loaded, restored from a recovery
snapshot, moved by the evaluation gate). The other ranks (:func:`follow`) keep one replica per model of rank 0,
make the same call on it and so run their slice of the batch. While idle, rank 0 broadcasts a heartbeat every
quarter of the collective timeout, so a dead rank fails the group at once and a hung one within the timeout.
How to launch a group and what fails how: ``docs/scaling-out.md``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from livelora.clients.errors import LiveloraError
from livelora.trainer.distributed import GroupFailedError, TrainerGroup

log = logging.getLogger(__name__)


def state_stamp(model: Any) -> tuple:
    """Identifies a model's weights and optimizer state without reading them: the identity and in-place version
    counter (``Tensor._version``, bumped by every in-place write) of each LoRA tensor and AdamW state tensor, the
    optimizer object and the step counter. Equal stamps: nothing was written since."""
    tensors = [*model.lora_params.values()]
    for state in model.optimizer.state.values():
        tensors.extend(t for t in state.values() if hasattr(t, "_version"))
    return (id(model.optimizer), model.step, *((id(t), t._version) for t in tensors))


def _on_cpu(value: Any) -> Any:
    """``value`` with every tensor in it copied to the CPU (so a rank unpickles none onto rank 0's GPU)."""
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_on_cpu(v) for v in value)
    return value.cpu() if hasattr(value, "cpu") and hasattr(value, "_version") else value


class GroupLeader:
    """Rank 0's side: broadcasts the mirrored calls, the heartbeat and the end of the group.

    Args:
        group: rank 0 of a joined group (``leader_of_group`` is set to this leader).
        on_failure: called once, from the thread that met it, when a collective fails (the trainer stops).
        heartbeat_s: idle time after which a heartbeat is broadcast (at most a quarter of the group's timeout).
    """

    def __init__(self, group: TrainerGroup, on_failure: Callable[[], None], heartbeat_s: float):
        self.group = group
        self.on_failure = on_failure
        self.heartbeat_s = heartbeat_s
        self._lock = threading.RLock()
        self._synced: dict[str, tuple] = {}  # model key → state stamp the other ranks have
        self._dropped: queue.SimpleQueue[str] = queue.SimpleQueue()  # models gone on rank 0, told with the next message
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        group.leader_of_group = self

    @property
    def failed(self) -> bool:
        return self.group.failed is not None

    def _send(self, message: dict[str, Any]) -> None:
        with self._lock:
            message["drop"] = []
            while not self._dropped.empty():
                message["drop"].append(self._dropped.get())
            try:
                self.group.broadcast(message)
            except GroupFailedError:
                self._fail()
                raise
            self._last = time.monotonic()

    def _fail(self) -> None:
        log.error("trainer group failed (%s): stopping; the leases are given back", self.group.failed)
        self._stop.set()
        self.on_failure()

    def _key(self, model: Any) -> str:
        key = getattr(model, "group_key", None)
        if key is None:
            key = model.group_key = uuid.uuid4().hex
            weakref.finalize(model, self._forget, key)
        return key

    def _forget(self, key: str) -> None:
        self._synced.pop(key, None)
        self._dropped.put(key)

    @contextlib.contextmanager
    def call(self, model: Any, name: str, args: tuple, kwargs: dict, fn: Callable | None = None) -> Iterator[None]:
        """Hold the group for one mirrored call of ``model.name(*args, **kwargs)`` (or of ``fn(model, *args,
        **kwargs)``, ``fn`` a module-level function): broadcast it (with the model's state when it changed), then
        run it here; a failed collective in it fails the group.

        Raises:
            GroupFailedError: the group failed (now or before).
        """
        from livelora.trainer.recovery import model_state

        with self._lock:
            key = self._key(model)
            stamp = state_stamp(model)
            state = None if self._synced.get(key) == stamp else _on_cpu(model_state(model))
            message = {"kind": "call", "key": key, "name": name, "args": args, "kwargs": kwargs, "state": state}
            message["fn"] = fn
            message.update(spec={"max_seq_len": model.max_seq_len}, fresh_grads=not model.has_gradients())
            self._send(message)
            try:
                yield
            except GroupFailedError:
                self._fail()
                raise
            finally:
                self._synced[key] = state_stamp(model)
                self._last = time.monotonic()

    def start(self) -> None:
        """Broadcast a heartbeat whenever the group was idle for ``heartbeat_s`` (daemon thread)."""
        self._thread = threading.Thread(target=self._beat, name="livelora-group-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.heartbeat_s / 4)):
            if time.monotonic() - self._last < self.heartbeat_s:
                continue
            with self._lock, contextlib.suppress(GroupFailedError):
                self._send({"kind": "ping"})

    def close(self) -> None:
        """Stop the heartbeat and tell the other ranks to exit (nothing to tell a failed group)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self.failed:
            with contextlib.suppress(GroupFailedError):
                self._send({"kind": "exit"})


def follow(group: TrainerGroup, build: Callable[[dict[str, Any], dict[str, Any]], Any]) -> None:
    """A rank other than 0: run rank 0's mirrored calls on replicas until rank 0 says exit.

    Args:
        build: ``(state, spec) → TrainingModel`` in that state (:func:`~livelora.trainer.recovery.restore_model`).

    Raises:
        GroupFailedError: rank 0 died or was silent longer than the group's timeout.
    """
    from livelora.trainer.recovery import load_into

    replicas: dict[str, Any] = {}
    while True:
        message = group.broadcast(None)
        for key in message.get("drop", ()):
            replicas.pop(key, None)
        if message["kind"] == "exit":
            return
        if message["kind"] != "call":
            continue
        key, state = message["key"], message["state"]
        model = replicas.get(key)
        if state is not None:
            if model is None or {**model.lora.model_dump(), "alpha": model.alpha} != state["lora"]:
                model = replicas[key] = build(state, message["spec"])
            else:
                load_into(model, state)
        if message["fresh_grads"]:
            model.zero_grad()
        try:
            fn = message.get("fn")
            call = functools.partial(fn, model) if fn is not None else getattr(model, message["name"])
            call(*message["args"], **message["kwargs"])
        except LiveloraError as exc:  # rank 0 meets the same error on the same input
            log.info("mirrored %s failed as on rank 0: %s", message["name"], exc)
