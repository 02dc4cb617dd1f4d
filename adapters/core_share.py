"""Sharing the CPU cores of one machine between the inference engine and training steps.

On a CPU machine the transformers engine runs its matmuls on an OpenMP pool of ``engine_threads``. When a training
step runs on the same machine, one of those threads shares its core with the step, and the engine's threads wait
for it at every parallel region: measured on 2 cores with 8 streams, serving fell to 0.35x of its speed during
KTO steps with two engine threads, but kept 0.90x with one (README, "Serving first"). So the engine uses every
core while no step runs and fewer (``engine_threads_while_training``) while one does.

The signal is a file per machine, ``<home>/run/training-<hostname>``, holding the pid of the process running a
step: :class:`TrainingFlag` ``held()`` writes it for the duration of a step (the trainer), :meth:`TrainingFlag.active`
reads it (the engine, once per scheduler iteration, about 10 µs). A flag whose pid no longer runs (a trainer
killed mid-step) counts as absent, so a crash never leaves the engine throttled.

Example::

    flag = TrainingFlag(home)
    with flag.held():        # trainer: around forward_backward + optim_step
        ...
    flag.active()            # engine: True while a step runs on this machine
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path


class TrainingFlag:
    """The "a training step runs on this machine" flag of store ``home``.

    Args:
        home: the store root (``LIVELORA_HOME``); the flag lives in ``<home>/run/``.
    """

    def __init__(self, home: Path | str):
        self.path = Path(home) / "run" / f"training-{socket.gethostname()}"

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the flag (this process's pid in the file) while the ``with`` body runs; removed on exit, also when
        the body raises. Never raises for a file-system error (the flag only steers thread counts)."""
        wrote = False
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(str(os.getpid()))
            os.replace(tmp, self.path)
            wrote = True
        try:
            yield
        finally:
            if wrote:
                with contextlib.suppress(OSError):
                    if self.path.read_text().strip() == str(os.getpid()):
                        self.path.unlink()

    def active(self) -> bool:
        """Whether a live process holds the flag (a missing or unreadable file, or a dead pid: ``False``)."""
        try:
            pid = int(self.path.read_text().strip())
        except (OSError, ValueError):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, another user's
            return True
        return True
