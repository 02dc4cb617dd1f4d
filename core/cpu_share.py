"""Sharing the CPU cores of one machine between the inference engine and training steps.

Two files per machine under ``<home>/run/`` carry the signals: :class:`TrainingFlag` (the pid of the process
running a step; the engine uses fewer threads while it is held, and a dead pid counts as absent) and
:class:`ServingFlag` (the engine's heartbeat; a trainer runs a step with all its idle threads only when no
engine has beaten for :data:`SERVING_WINDOW_S`, :func:`apply_step_threads`). :class:`StepPacer` caps a
trainer's share of wall time in steps while an engine serves. Measurements and reasons:
``docs/internals/core-sharing.md``.

Example::

    with TrainingFlag(home).held():   # trainer: around forward_backward + optim_step
        ...
    TrainingFlag(home).active()       # engine: True while a step runs on this machine
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from livelora.core.atomic import private_dir


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _write_pid(path: Path) -> None:
    """Write this process's pid to ``path`` whole (temporary file + rename). Raises: OSError."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, path)


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
            _write_pid(self.path)
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
        return pid_alive(pid)


#: Seconds since the engine's last beat during which it counts as serving (it beats at least every
#: :data:`BEAT_EVERY_S` while it has work; a gap between two requests shorter than this counts as busy).
SERVING_WINDOW_S = 2.0
BEAT_EVERY_S = 0.5


class ServingFlag:
    """The "an engine on this machine is serving requests" heartbeat of store ``home``.

    Args:
        home: the store root (``LIVELORA_HOME``); the file is ``<home>/run/serving-<hostname>``.
    """

    def __init__(self, home: Path | str):
        self.path = Path(home) / "run" / f"serving-{socket.gethostname()}"
        self._last = 0.0

    def beat(self) -> None:
        """Renew the heartbeat (this process's pid in the file, its mtime now); at most every :data:`BEAT_EVERY_S`
        seconds, so calling it on every engine iteration costs a clock read. Never raises (it only steers
        thread counts)."""
        now = time.monotonic()
        if now - self._last < BEAT_EVERY_S:
            return
        self._last = now
        with contextlib.suppress(OSError):
            try:
                if self.path.read_text().strip() == str(os.getpid()):
                    os.utime(self.path)
                    return
            except (OSError, ValueError):
                pass
            _write_pid(self.path)

    def busy(self, within_s: float = SERVING_WINDOW_S) -> bool:
        """Whether a live engine beat within the last ``within_s`` seconds (no file, an old one, or a dead pid:
        ``False``)."""
        try:
            age = time.time() - self.path.stat().st_mtime
            pid = int(self.path.read_text().strip())
        except (OSError, ValueError):
            return False
        return age <= within_s and pid_alive(pid)


class StepThreads:
    """Torch threads for a trainer process's next step: ``idle`` while no engine on this machine serves, ``busy``
    otherwise (docs/internals/core-sharing.md).

    Args:
        home: the store root. busy: threads while serving (the process's budget). idle: threads otherwise.
    """

    def __init__(self, home: Path | str, busy: int, idle: int):
        self.serving, self.busy, self.idle = ServingFlag(home), max(1, busy), max(1, idle)

    def apply(self) -> int:
        """Set torch's thread count for the step about to run (process-wide); returns it."""
        import torch  # not at module level: adapters/ is imported by processes without torch

        want = self.busy if self.serving.busy() else self.idle
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        return want


class StepPacer:
    """Keeps a trainer's share of wall time in training steps at most ``duty`` while an engine on this machine
    serves. Inside a step it yields at every :func:`step_yield` point (between the step's forward and backward
    passes): it sleeps until the step's active time is at most ``duty`` of the time since the step began
    (``pause = active·(1 − duty)/duty − paused so far``); what the step still owes at its end (active time after the
    last yield point) is paid before the next step, less the idle time in between (:meth:`wait_before_step` says
    how long; a trainer worker defers its next step that long instead of sleeping). Every pause is at most
    ``max_pause_s`` and ends as soon as nothing is served. The signals of a paused step wait in their queue (none
    is lost); the next batch may hold more of them.

    Args:
        home: the store root. duty: largest share of time in steps while serving, in (0, 1] (1: never pause).
        max_pause_s: longest single pause (seconds).
    """

    def __init__(self, home: Path | str, duty: float, max_pause_s: float = 60.0):
        self.serving, self.duty, self.max_pause_s = ServingFlag(home), duty, max_pause_s
        self.owed_s = 0.0  # pause the last step still owed at its end (seconds)
        self.last_end = 0.0  # time.monotonic() when it ended
        self.started: float | None = None  # time.monotonic() when the running step began (None: no step runs)
        self.paused_in = 0.0  # pauses inside the running step (seconds)
        self.paused_s = 0.0  # total pause (seconds), for logs and tests
        #: called with True before a pause and False after it (``on_step_pause``); never with a pause of 0 s
        self.listener: Callable[[bool], None] | None = None

    def _sleep(self, wait: float) -> float:
        """Sleep up to ``wait`` seconds (at most ``max_pause_s``) in slices of at most :data:`BEAT_EVERY_S`, ending
        early once nothing is served; returns the seconds slept."""
        wait = min(max(wait, 0.0), self.max_pause_s)
        if wait <= 0:
            return 0.0
        if self.listener is not None:
            self.listener(True)
        slept = 0.0
        try:
            while slept < wait:
                piece = min(BEAT_EVERY_S, wait - slept)
                time.sleep(piece)
                slept += piece
                if not self.serving.busy():
                    break
        finally:
            self.paused_s += slept
            if self.listener is not None:
                self.listener(False)
        return slept

    def _owed(self, started: float) -> float:
        active = time.monotonic() - started - self.paused_in
        return active * (1.0 - self.duty) / self.duty - self.paused_in

    def wait_before_step(self) -> float:
        """Seconds the next step should still wait: what the last step owed (at most ``max_pause_s``) less the
        time since it ended; 0 while nothing is served or with ``duty`` 1."""
        if self.duty >= 1.0 or self.owed_s <= 0 or not self.serving.busy():
            return 0.0
        return max(0.0, min(self.owed_s, self.max_pause_s) - (time.monotonic() - self.last_end))

    def pause_before_step(self) -> float:
        """Sleep :meth:`wait_before_step`; returns the seconds slept."""
        return self._sleep(self.wait_before_step())

    def begin(self) -> None:
        """A step starts (after :meth:`pause_before_step`)."""
        self.started, self.paused_in = time.monotonic(), 0.0

    def between(self) -> float:
        """At a yield point inside the running step: sleep while its active share is above ``duty`` and requests
        are served; returns the seconds slept."""
        if self.duty >= 1.0 or self.started is None or not self.serving.busy():
            return 0.0
        slept = self._sleep(self._owed(self.started))
        self.paused_in += slept
        return slept

    def end(self) -> None:
        """The running step ended."""
        if self.started is not None:
            self.owed_s = self._owed(self.started)
            self.last_end, self.started = time.monotonic(), None


_step_threads: StepThreads | None = None
_pacer: StepPacer | None = None


def configure_training_steps(
    home: Path | str, busy: int, idle: int, duty: float = 1.0, max_pause_s: float = 60.0
) -> None:
    """Make :func:`training_step` choose between ``busy`` and ``idle`` threads in this process and keep its share
    of time in steps at most ``duty`` while requests are served (:class:`StepPacer`, each pause at most
    ``max_pause_s``). A trainer process sets it
    (``livelora serve``'s child); a trainer in the serving process's threads never does, since torch's thread
    count is process-wide there and the engine's own threads must not sleep."""
    global _step_threads, _pacer
    _step_threads = StepThreads(home, busy, idle) if idle != busy else None
    _pacer = StepPacer(home, duty, max_pause_s) if duty < 1.0 else None


def apply_step_threads() -> int | None:
    """Before a training step: the configured :class:`StepThreads` choice (``None`` when not configured: the
    thread count is left as it is)."""
    return _step_threads.apply() if _step_threads is not None else None


@contextlib.contextmanager
def training_step() -> Iterator[None]:
    """Around one training step of a trainer process: the configured pause (:class:`StepPacer`), then the
    thread choice (:class:`StepThreads`), then the step, whose :func:`step_yield` points may pause it. Without
    :func:`configure_training_steps` it does nothing."""
    if _pacer is not None:
        _pacer.pause_before_step()
        _pacer.begin()
    apply_step_threads()
    try:
        yield
    finally:
        if _pacer is not None:
            _pacer.end()


def step_yield() -> float:
    """A point inside a training step where serving may go first (between forward and backward passes): the
    configured :class:`StepPacer` sleeps here while the step is over its share; returns the seconds slept (0 when
    no pacer is configured, outside :func:`training_step`, or while nothing is served)."""
    return _pacer.between() if _pacer is not None else 0.0


def step_wait() -> float:
    """Seconds a trainer process should still wait before it starts its next step (:meth:`StepPacer.
    wait_before_step`; 0 when no pacer is configured or nothing is served)."""
    return _pacer.wait_before_step() if _pacer is not None else 0.0


def serving_duty() -> float | None:
    """The configured duty while serving, when below 1 (``None``: the trainer never yields to serving)."""
    return _pacer.duty if _pacer is not None else None


def on_step_pause(listener: Callable[[bool], None] | None) -> None:
    """Call ``listener(True)`` before each pause of the configured :class:`StepPacer` and ``listener(False)``
    after it (a trainer's learning status says so); ``None`` removes it. No-op when no pacer is configured."""
    if _pacer is not None:
        _pacer.listener = listener
