"""A trainer group: one training model run by N ranks of ``torch.distributed`` (data parallelism).

Every rank holds the whole model; each batch is split into contiguous slices (:func:`shard`), each rank runs the
logprob pass of its slice only, the per-datum logprobs are all-gathered, and every rank computes the loss over
the **whole** batch with its own slice's logprobs carrying gradient and the others' as constants
(:meth:`TrainerGroup.gather`). Summed over ranks, the gradients are exactly the one-process gradient of the
whole-batch loss (sums and means normalised over the whole batch, pairs and KTO's batch-wide KL point included);
:meth:`TrainerGroup.all_reduce_grads` sums them over the LoRA parameters only before each optimizer step.
Why not DDP, the backends and the failure behaviour: ``docs/scaling-out.md``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

#: Environment variables a launcher (``torchrun``, ``livelora trainer --nproc``) sets for each rank.
RANK_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_CURRENT: TrainerGroup | None = None


class GroupFailedError(RuntimeError):
    """A collective of the trainer group failed: a rank died, hung past the group's timeout, or the group was
    already failed. The op or step that met it is not committed; the rank's trainer stops."""


def current_group() -> TrainerGroup | None:
    """The group this process is a rank of (:meth:`TrainerGroup.join` with ``current=True``), else None; every
    :class:`~livelora.trainer.model.TrainingModel` built without ``group=`` runs on it."""
    return _CURRENT


def mirrored(method: Callable) -> Callable:
    """Decorate a :class:`~livelora.trainer.model.TrainingModel` method that runs collectives: on rank 0 of a
    group with a leader (:class:`~livelora.trainer.group_mirror.GroupLeader`) the call is first broadcast to the
    other ranks, which make it on their replica; elsewhere the method runs as it is."""

    @functools.wraps(method)
    def call(model: Any, *args: Any, **kwargs: Any) -> Any:
        leader = getattr(model.group, "leader_of_group", None)
        if leader is None:
            return method(model, *args, **kwargs)
        with leader.call(model, method.__name__, args, kwargs):
            return method(model, *args, **kwargs)

    return call


def shard(n: int, rank: int, world_size: int) -> range:
    """The datums of a batch of ``n`` that ``rank`` runs: contiguous, sizes differing by at most one, the first
    ``n mod world_size`` ranks one longer (3 on 2 ranks: ``range(0, 2)``, ``range(2, 3)``; a rank may get none)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


@dataclass
class TrainerGroup:
    """The process group a training model runs on (this process is rank ``rank`` of ``world_size``).

    Attributes:
        rank, world_size: this process's place in the group.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
        device: the torch device collectives run on (``cpu`` for gloo, this rank's GPU for nccl).
        collective_s: seconds this rank has spent in the group's collectives (waiting for the others included).
        leader_of_group: rank 0's :class:`~livelora.trainer.group_mirror.GroupLeader` in a group process (None:
            the ranks make the same calls themselves, as in tests and ``bench/train.py``).
        failed: the first collective error (then every collective raises :class:`GroupFailedError`).
        shard_base: models built on this group shard their frozen base weights over the ranks with FSDP2
            (:mod:`livelora.trainer.shard_base`; ``LIVELORA_GROUP_SHARD_BASE``).
    """

    rank: int
    world_size: int
    backend: str
    device: torch.device
    collective_s: float = field(default=0.0, compare=False)
    leader_of_group: Any = field(default=None, compare=False, repr=False)
    failed: BaseException | None = field(default=None, compare=False, repr=False)
    shard_base: bool = False

    @contextlib.contextmanager
    def _timed(self):
        if self.failed is not None:
            raise GroupFailedError(f"trainer group failed before: {self.failed}")
        start = time.perf_counter()
        try:
            yield
        except Exception as exc:
            self.failed = exc
            raise GroupFailedError(f"rank {self.rank}: a collective of the trainer group failed: {exc}") from exc
        finally:
            self.collective_s += time.perf_counter() - start

    @property
    def leader(self) -> bool:
        """Rank 0: the group's only voice on Redis and in the store."""
        return self.rank == 0

    @classmethod
    def join(
        cls,
        *,
        backend: str | None = None,
        timeout_s: float = 60.0,
        device: str = "cpu",
        current: bool = False,
        shard_base: bool = False,
    ) -> TrainerGroup:
        """Join (or create) the default process group from the launcher's environment (``RANK``, ``WORLD_SIZE``,
        ``MASTER_ADDR``, ``MASTER_PORT``). ``backend``: None = ``nccl`` on a CUDA ``device``, else ``gloo``.
        ``timeout_s``: how long a collective waits for a dead or hung rank before it raises (the group then
        fails and rank 0 gives its leases back). ``current``: models built in this process run on it
        (:func:`current_group`). ``shard_base``: see the class's attributes.

        Raises:
            RuntimeError: the rendezvous fails or times out.
        """
        dev = torch.device(device)
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        if backend == "nccl" and dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        collective_dev = dev if backend == "nccl" else torch.device("cpu")
        group = cls(dist.get_rank(), dist.get_world_size(), backend, collective_dev, shard_base=shard_base)
        if current:
            global _CURRENT
            _CURRENT = group
        return group

    def shard(self, n: int) -> range:
        """This rank's datums of a batch of ``n`` (:func:`shard`)."""
        return shard(n, self.rank, self.world_size)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; an op, a live-loop batch, a decision)."""
        box = [obj if self.leader else None]
        with self._timed():
            dist.broadcast_object_list(box, src=0, device=self.device if self.backend == "nccl" else None)
        return box[0]

    def gather(self, n: int, own: Sequence[Tensor]) -> list[Tensor]:
        """All ``n`` per-datum tensors of a batch, in batch order, from each rank's ``own`` slice (its
        :meth:`shard`). This rank's tensors are returned as they are (with their autograd graph); the others'
        arrive detached on this rank's device.

        Raises:
            ValueError: ``own`` does not have one tensor per datum of this rank's slice.
        """
        mine = self.shard(n)
        if len(own) != len(mine):
            raise ValueError(f"rank {self.rank} holds {len(own)} tensors for a slice of {len(mine)}")
        parts: list[Any] = [None] * self.world_size
        with self._timed():
            dist.all_gather_object(parts, [t.detach().cpu() for t in own])
        dev = own[0].device if own else None
        out: list[Tensor] = []
        for r, part in enumerate(parts):
            out.extend(own if r == self.rank else [t if dev is None else t.to(dev) for t in part])
        return out

    def all_reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks in place (one flat buffer, one ``all_reduce``); a
        missing gradient counts as zeros. Afterwards every rank holds the same gradients."""
        plist = list(params)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in plist]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.device)
        with self._timed():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p, g in zip(plist, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).to(p.device).clone()
            offset += n

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        t = torch.tensor([0 if flag else 1], dtype=torch.int64, device=self.device)
        with self._timed():
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return int(t.item()) == 0

    def barrier(self) -> None:
        """Wait for every rank (raises after the group's timeout when one is dead or hung)."""
        with self._timed():
            dist.barrier()

    def close(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()
