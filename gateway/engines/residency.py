"""Hot and cold adapter versions of a CPU engine: at most ``limit`` versions keep their weights in the backend
(resident); the others are cold (the backend keeps a copy on its own disk, :meth:`ModelBackend.evict`) and are
loaded back when a request needs them. Runs on the batching loop's thread. Why and the figures:
``docs/serving.md`` (Serving many versions at once).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from livelora.core import metrics

log = logging.getLogger(__name__)

#: Share of the machine's memory (the GPU's on CUDA) that resident versions may take when no limit is set.
MEMORY_SHARE = 0.1
#: Highest default limit (a derived one beyond it would only cost bookkeeping).
MAX_DEFAULT_LIMIT = 4096


def memory_bytes(device: str) -> int:
    """Total memory of ``device`` in bytes: the GPU's on ``cuda``, the machine's physical memory otherwise."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Residency:
    """Which adapter versions are resident, least recently used first, and the bound on them.

    Args:
        backend: the loop's :class:`~livelora.gateway.engines.batching.ModelBackend` (``evict``, ``restore``,
            ``version_bytes``).
        limit: resident versions at most; ``None`` derives it once the first version is resident: the
            :data:`MEMORY_SHARE` of ``memory`` over that version's bytes, at least ``floor`` (the batch size, so
            that a full batch of distinct versions fits) and at most :data:`MAX_DEFAULT_LIMIT`.
        memory: bytes of the device's memory (:func:`memory_bytes`).
        floor: the smallest derived limit.

    Attributes:
        resident: resident version names, least recently used first.
        cold: names of versions that are loaded but not resident.
        loads, evictions: cold versions loaded back, and versions made cold, so far.
    """

    def __init__(self, backend: Any, limit: int | None, memory: int, floor: int):
        self.backend = backend
        self._limit = limit
        self.memory, self.floor = memory, max(1, floor)
        self.resident: OrderedDict[str, None] = OrderedDict()
        self.cold: set[str] = set()
        self.loads = 0
        self.evictions = 0

    @property
    def limit(self) -> int:
        """Resident versions at most (the setting, or derived from memory: see the class docstring)."""
        if self._limit is None and self.resident:
            size = max(1, self.backend.version_bytes(next(iter(self.resident))))
            self._limit = min(MAX_DEFAULT_LIMIT, max(self.floor, int(self.memory * MEMORY_SHARE) // size))
            log.info("at most %d adapter versions resident (%d bytes each)", self._limit, size)
        return self._limit if self._limit is not None else MAX_DEFAULT_LIMIT

    def added(self, name: str, busy: Iterable[str | None]) -> None:
        """Version ``name`` was installed: it is resident, most recently used; older idle ones are evicted while
        over the limit (none that ``busy`` names, so the count may stay above it until they drain)."""
        self.resident[name] = None
        self._count()
        self.make_room(0, {name, *busy})

    def ensure(self, name: str | None, busy: Iterable[str | None], force: bool = False) -> bool:
        """Make ``name`` resident (``None``, the base model, always is): ``True`` when it is; ``False`` when the
        limit is reached and every resident version is in ``busy`` (the caller waits), unless ``force``.

        Raises:
            What :meth:`ModelBackend.restore` raises (the version stays cold).
        """
        if name is None or name in self.resident:
            if name is not None:
                self.resident.move_to_end(name)
            return True
        if not self.make_room(1, set(busy)) and not force:
            return False
        self.backend.restore(name)
        self.cold.discard(name)
        self.resident[name] = None
        self.loads += 1
        metrics.VERSION_LOADS.inc()
        self._count()
        return True

    def make_room(self, extra: int, busy: set[str | None]) -> bool:
        """Evict the least recently used versions not in ``busy`` until ``extra`` more fit the limit; ``False``
        if they cannot."""
        while len(self.resident) + extra > self.limit:
            victim = next((n for n in self.resident if n not in busy), None)
            if victim is None:
                return False
            self.backend.evict(victim)
            del self.resident[victim]
            self.cold.add(victim)
            self.evictions += 1
            metrics.VERSION_EVICTIONS.inc()
            log.info("version %s is cold now (%d resident, limit %d)", victim, len(self.resident), self.limit)
        self._count()
        return True

    def forget(self, name: str) -> None:
        """Version ``name`` was unloaded (resident or cold: :meth:`ModelBackend.uninstall` frees either)."""
        self.cold.discard(name)
        self.resident.pop(name, None)
        self._count()

    def _count(self) -> None:
        metrics.RESIDENT_VERSIONS.set(len(self.resident))


#: Name of a backend's directory of cold copies: ``<prefix><pid>-<random>`` in the temp dir.
COLD_PREFIX = "livelora-cold-versions-"


def cold_dir() -> Path:
    """A new private directory for a backend's cold copies; those of processes that are gone (killed before
    their backend closed) are removed first."""
    from livelora.core.cpu_share import pid_alive

    tmp = Path(tempfile.gettempdir())
    for path in tmp.glob(f"{COLD_PREFIX}*-*"):
        pid = path.name[len(COLD_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{COLD_PREFIX}{os.getpid()}-"))
