"""Asynchronous RL building blocks: samplers running beside the trainer, sampler versions and the staleness
bound, and a step's gradient accumulated over mini-batches.

Versions: the trainer's version is the number of optimizer steps done; a sampling client snapshotted after k
steps has version k, and every :class:`Batch` records the version of the sampler that produced it. Staleness of
a batch trained at trainer version ``v`` is ``v − sampler_version``. The bound is enforced by **dropping**:
a batch is trained iff ``v − sampler_version ≤ max_staleness`` (tinker-cookbook ``rl/train.py``'s
``max_steps_off_policy`` does the same); a dropped batch is counted, never reweighted. What remains
off-policy inside the bound is corrected by the loss with the sampler's logprobs (``importance_sampling``:
ratio ``π/q``; ``cispo``: the clipped, stopped ratio; docs/internals/losses.md).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from livelora.clients.recipes.datums import chunks


@dataclass
class Batch:
    """One sampled batch: ``index`` (its number in the run: what ``sample(index, sampler)`` drew),
    ``sampler_version`` (optimizer steps done when its sampler's weights were snapshotted), ``data``."""

    index: int
    sampler_version: int
    data: Any


def fresh_enough(batch: Batch, trainer_version: int, max_staleness: int) -> bool:
    """The staleness rule: train ``batch`` iff ``trainer_version − batch.sampler_version ≤ max_staleness``."""
    return trainer_version - batch.sampler_version <= max_staleness


class AsyncSampler:
    """``workers`` threads that keep sampling batches (0, 1, 2, ...) from the newest sampler while the trainer
    trains; at most ``queue_size`` finished batches wait.

    Args:
        sample: ``(index, sampling_client) -> data`` (runs in a worker thread).
        sampler, version: the first sampling client and its version.
        first_index: the first batch index (a resumed run starts past the batches it trained).
        last_index: draw no batch past it (the run's last step), plus one more for each batch dropped.

    :meth:`update` publishes new weights after an optimizer step; :meth:`next_fresh` returns the next batch
    within the staleness bound (dropping older ones); :meth:`close` stops the workers. An exception raised
    by ``sample`` is re-raised by :meth:`next_fresh`.
    """

    def __init__(
        self,
        sample: Callable[[int, Any], Any],
        sampler: Any,
        version: int,
        *,
        workers: int = 1,
        queue_size: int = 1,
        first_index: int = 0,
        last_index: int | None = None,
    ):
        self._sample, self._current = sample, (sampler, version)
        self._lock = threading.Condition()
        self._next, self._last = first_index, last_index
        self._done = threading.Event()
        self._out: queue.Queue[Batch | BaseException] = queue.Queue(maxsize=max(1, queue_size))
        self._threads = [
            threading.Thread(target=self._work, name=f"rl-sampler-{i}", daemon=True) for i in range(max(1, workers))
        ]
        for t in self._threads:
            t.start()

    def update(self, sampler: Any, version: int) -> None:
        """Sample from ``sampler`` (weights after ``version`` optimizer steps) from now on."""
        with self._lock:
            self._current = (sampler, version)

    def _work(self) -> None:
        while not self._done.is_set():
            with self._lock:
                if self._last is not None and self._next > self._last:
                    self._lock.wait(0.2)  # every batch the run needs is drawn, unless one is dropped
                    continue
                index, (sampler, version) = self._next, self._current
                self._next += 1
            try:
                item: Batch | BaseException = Batch(index, version, self._sample(index, sampler))
            except BaseException as exc:  # handed to the trainer, which raises it
                item = exc
            while not self._done.is_set():
                try:
                    self._out.put(item, timeout=0.2)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def next_fresh(self, trainer_version: int, max_staleness: int) -> tuple[Batch, int]:
        """The next batch with ``trainer_version − sampler_version ≤ max_staleness`` and how many older ones
        were dropped to reach it."""
        dropped = 0
        while True:
            item = self._out.get()
            if isinstance(item, BaseException):
                raise item
            if fresh_enough(item, trainer_version, max_staleness):
                return item, dropped
            dropped += 1
            with self._lock:
                if self._last is not None:
                    self._last += 1
                    self._lock.notify_all()

    def close(self) -> None:
        self._done.set()
        with self._lock:
            self._lock.notify_all()
        while True:  # unblock workers waiting on a full queue
            try:
                self._out.get_nowait()
            except queue.Empty:
                break


def forward_backward_minibatches(tc: Any, data: Sequence[Any], loss: str, num_minibatches: int) -> tuple[list, float]:
    """Accumulate one step's gradient over ``num_minibatches`` ``forward_backward`` calls (all submitted before
    the first result is read); the caller then runs one ``optim_step``. The losses are sums over tokens, so
    the accumulated gradient equals the full batch's (``∇Σ_b L_b = Σ_b ∇L_b``).

    Returns: the datums' ``loss_fn_outputs`` in order and the summed ``loss:sum``.
    """
    size = max(1, -(-len(data) // max(1, num_minibatches)))
    futures = [tc.forward_backward(list(part), loss) for part in chunks(list(data), size)]
    outputs, total = [], 0.0
    for fut in futures:
        out = fut.result()
        outputs += list(out.loss_fn_outputs)
        total += float(out.metrics["loss:sum"])
    return outputs, total
