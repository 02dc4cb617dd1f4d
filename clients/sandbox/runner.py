"""Run one untrusted Python program: bubblewrap namespaces + rlimits, a wall clock, capped output, full cleanup.

Isolation (docs/code-rl.md has the why and what the hostile-program tests observed): ``bwrap --unshare-all``
(no network, own PID/IPC/UTS/user namespaces), a read-only ``/usr`` (with ``/etc/alternatives`` and
``/etc/ld.so.cache`` for shared libraries), a private work directory (the program's files) at ``/sandbox``, a
small private ``/tmp``, nothing else of the host (no rest of ``/etc``, no ``/home``, store or keys).
Limits are rlimits set before ``bwrap`` runs (CPU seconds, address space, processes, file size) and a wall clock
kept here; on the wall limit, output limit or exit, the whole process tree is killed (``bwrap``'s process group,
``--die-with-parent``, and the PID namespace dies with its init). Run as root, each run gets its own uid from a
pool so that the process limit counts that run alone. Without bubblewrap: rlimited subprocesses in their own
session (a loud warning; no network or file-system isolation) or, with ``require_isolation``, a refusal.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import resource
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Literal

log = logging.getLogger("livelora.sandbox")

Status = Literal["finished", "timeout", "output_limit", "sandbox_error"]

#: The program's file name in its work directory (the work directory is its cwd and ``sys.path[0]``).
PROGRAM = "__sandbox_main__.py"
INSIDE = "/sandbox"


_POOLS: dict[tuple[int, int], queue.Queue[int]] = {}
_POOLS_LOCK = threading.Lock()


class IsolationUnavailableError(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here, and isolation is required."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits. ``wall_s`` / ``cpu_s``: seconds (CPU rounded up to whole seconds, per process);
    ``memory_mb``: address space per process (MiB); ``max_processes``: processes and threads of the run;
    ``max_output_bytes``: stdout and stderr each (the pipe is cut there); ``max_file_mb``: largest file written;
    ``tmp_mb``: the private ``/tmp`` (bubblewrap only)."""

    wall_s: float = 10.0
    cpu_s: float = 10.0
    memory_mb: int = 512
    max_processes: int = 32
    max_output_bytes: int = 1_000_000
    max_file_mb: int = 16
    tmp_mb: int = 64


@dataclass
class RunResult:
    """One run. ``status``: ``finished`` (the program exited by itself; see ``exit_code``), ``timeout`` (wall
    limit), ``output_limit`` (stdout or stderr passed ``max_output_bytes``), ``sandbox_error`` (the sandbox
    failed; ``message``). ``exit_code``: the program's (128+N or −N when signal N ended it; None when killed by
    the sandbox). ``wall_s`` / ``cpu_s``: seconds. ``files``: the fetched files' bytes."""

    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float = 0.0
    isolated: bool = True
    message: str = ""
    files: dict[str, bytes] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "finished" and self.exit_code == 0


def _safe_name(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or name.startswith("~"):
        raise ValueError(f"file name {name!r} must be a relative path inside the work directory")
    return p


def _user_processes(uid: int) -> int:
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                n += entry.stat().st_uid == uid
    return n


def _zombie(pid: str) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rpartition(b")")[2].split()[0] == b"Z"


def _end_uid(uid: int, timeout_s: float = 10.0) -> None:
    """Kill every process of the run's own ``uid`` and wait until none is left alive (the PID namespace's members
    die asynchronously after its init), so that nothing outlives the run. Zombies are dead already: bwrap exits
    without reaping its namespace's init, whose zombie waits for the host's PID 1 (seconds, in some containers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = []
        for entry in os.scandir("/proc"):
            with contextlib.suppress(OSError):
                if entry.name.isdigit() and entry.stat().st_uid == uid and not _zombie(entry.name):
                    pids.append(int(entry.name))
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    log.warning("sandbox uid %d still has processes after %.0f s", uid, timeout_s)


def _probe_bwrap(bwrap: str | None, binds: list[str]) -> str:
    """'' when ``bwrap`` runs a namespace here, else why not."""
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed (Debian: apt-get install bubblewrap)"
    try:
        r = subprocess.run(
            [bwrap, "--unshare-all", "--die-with-parent", *binds, "true"], capture_output=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap failed to start: {exc}"
    return "" if r.returncode == 0 else f"bwrap cannot create namespaces here: {r.stderr.decode(errors='replace')}"


class Sandbox:
    """Runs Python programs under :class:`Limits`; thread-safe (each run has its own directory and uid).

    Args:
        limits: the default limits (a run may pass others).
        require_isolation: refuse to be built without working bubblewrap (IsolationUnavailableError).
        python: the interpreter inside the sandbox (default ``/usr/bin/python3``, else ``python3`` on PATH); its
            installation is bound read-only, nothing else of its environment (no site-packages of a venv).
        uid_base, uid_pool: run as root, each run gets a uid in ``[uid_base, uid_base + uid_pool)``.
    """

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        require_isolation: bool = False,
        python: str | None = None,
        uid_base: int = 64000,
        uid_pool: int = 64,
    ):
        self.limits = limits or Limits()
        exe = python or ("/usr/bin/python3" if os.path.exists("/usr/bin/python3") else shutil.which("python3"))
        if exe is None:
            raise IsolationUnavailableError("no python3 interpreter found for the sandbox")
        self.python = exe
        self._binds = self._system_binds(exe)
        self.why_not_isolated = _probe_bwrap(shutil.which("bwrap"), self._binds)
        self.isolated = not self.why_not_isolated
        if not self.isolated:
            if require_isolation:
                raise IsolationUnavailableError(self.why_not_isolated + "; refusing to run without isolation")
            log.warning(
                "SANDBOX NOT ISOLATED: %s. Programs run as rlimited subprocesses with the host's network and "
                "file system visible; set require_isolation (LIVELORA_SANDBOX_REQUIRE_ISOLATION=1) to refuse.",
                self.why_not_isolated,
            )
        self._root = os.geteuid() == 0
        with _POOLS_LOCK:  # one pool per uid range in this process, shared by every Sandbox on it
            if (uid_base, uid_pool) not in _POOLS:
                _POOLS[(uid_base, uid_pool)] = pool = queue.Queue()
                for uid in range(uid_base, uid_base + uid_pool):
                    pool.put(uid)
            self._uids: queue.Queue[int] = _POOLS[(uid_base, uid_pool)]

    @staticmethod
    def _system_binds(exe: str) -> list[str]:
        binds = ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
            if os.path.islink(top):
                binds += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                binds += ["--ro-bind", top, top]
        for shared in ("/etc/alternatives", "/etc/ld.so.cache"):  # shared-library links (numpy's BLAS); no secrets
            if os.path.exists(shared):
                binds += ["--ro-bind", shared, shared]
        real = os.path.realpath(exe)
        if not real.startswith(("/usr/", "/bin/", "/lib")):
            prefix = str(Path(real).parent.parent)
            binds += ["--ro-bind", prefix, prefix]
        return binds

    def run(
        self,
        code: str,
        *,
        files: dict[str, bytes] | None = None,
        stdin: bytes | str = b"",
        limits: Limits | None = None,
        fetch_files: tuple[str, ...] | list[str] = (),
    ) -> RunResult:
        """Run ``code`` (Python source) as ``python3 __sandbox_main__.py`` in a fresh work directory holding
        ``files`` (relative name → bytes), with ``stdin``; return what happened (never raises for the program's
        behaviour). Raises: ValueError for a file name outside the work directory."""
        lim = limits or self.limits
        names = {str(_safe_name(n)): data for n, data in (files or {}).items()}
        uid = self._uids.get() if self._root else os.getuid()
        work = Path(tempfile.mkdtemp(prefix="livelora-sandbox-"))
        try:
            for name, data in {**names, PROGRAM: code.encode()}.items():
                path = work / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            if self._root:
                for p in [work, *work.rglob("*")]:
                    os.chown(p, uid, uid)
            result = self._execute(work, uid, lim, stdin.encode() if isinstance(stdin, str) else stdin)
            if self._root:
                _end_uid(uid)
            for name in fetch_files:
                result.files.update(self._fetch(work, name, lim))
            return result
        finally:
            shutil.rmtree(work, ignore_errors=True)
            if self._root:
                self._uids.put(uid)

    def _command(self, work: Path, lim: Limits) -> list[str]:
        run = [self.python, "-s", "-B", PROGRAM]
        if not self.isolated:
            return run
        return [
            "bwrap",
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            *self._binds,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(lim.tmp_mb << 20),
            "--tmpfs",
            "/tmp",
            "--bind",
            str(work),
            INSIDE,
            "--remount-ro",  # the sandbox's own root (its mount points) read-only too: only /sandbox, /tmp write
            "/",
            "--chdir",
            INSIDE,
            *run,
        ]

    def _execute(self, work: Path, uid: int, lim: Limits, stdin: bytes) -> RunResult:
        nproc = lim.max_processes + (0 if self._root else _user_processes(uid))
        cpu = max(1, math.ceil(lim.cpu_s))

        def limit() -> None:  # in the child, before exec: inherited by bwrap and everything it starts
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            resource.setrlimit(resource.RLIMIT_AS, (lim.memory_mb << 20, lim.memory_mb << 20))
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            resource.setrlimit(resource.RLIMIT_FSIZE, (lim.max_file_mb << 20, lim.max_file_mb << 20))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        env = {"PATH": "/usr/bin:/bin", "HOME": INSIDE if self.isolated else str(work), "LANG": "C.UTF-8"}
        t0 = time.monotonic()
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin)
            stdin_file.seek(0)
            try:
                proc = subprocess.Popen(
                    self._command(work, lim),
                    cwd=work,
                    env=env,
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    user=uid if self._root else None,
                    group=uid if self._root else None,
                    extra_groups=[] if self._root else None,
                    preexec_fn=limit,
                )
            except OSError as exc:
                return RunResult("sandbox_error", None, "", "", 0.0, isolated=self.isolated, message=str(exc))
        status, out, err, (wait_status, usage) = self._collect(proc, t0 + lim.wall_s, lim.max_output_bytes)
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        wall = time.monotonic() - t0
        code = proc.returncode if status == "finished" else None
        message = {"timeout": f"wall time limit {lim.wall_s:g} s", "output_limit": "output limit"}.get(status, "")
        sig = -code if code is not None and code < 0 else (code - 128 if code is not None and code > 128 else 0)
        if sig in (signal.SIGXCPU, signal.SIGKILL) and status == "finished":
            message = f"killed by {signal.Signals(sig).name} (CPU time limit {cpu} s or memory)"
        decode = lambda b: b.decode("utf-8", errors="replace")  # noqa: E731
        return RunResult(
            status,
            code,
            decode(out),
            decode(err),
            wall,
            usage.ru_utime + usage.ru_stime,
            self.isolated,
            message,
        )

    @staticmethod
    def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[Status, bytes, bytes, tuple]:
        """Read stdout/stderr until both close, the wall deadline or the cap; then kill the process group and
        reap the program (its wait status and rusage)."""
        bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        sel = selectors.DefaultSelector()
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        status: Status = "finished"
        reaped = None
        try:
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    status = "timeout"
                    break
                for key, _ in sel.select(min(left, 0.2)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                        continue
                    buf = bufs[key.fd]
                    buf += chunk[: cap + 1 - len(buf)]
                    if len(buf) > cap:
                        del buf[cap:]
                        status = "output_limit"
                if status == "output_limit":
                    break
                if reaped is None:
                    pid, wait_status, usage = os.wait4(proc.pid, os.WNOHANG)
                    reaped = (wait_status, usage) if pid else None
                if reaped is None:
                    continue
                # the program has exited: children it left (same session) hold the pipes open; end them
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            sel.close()
            proc.stdout.close()
            proc.stderr.close()
            if reaped is None:
                reaped = os.wait4(proc.pid, 0)[1:]
        out, err = bufs.values()
        return status, bytes(out), bytes(err), reaped

    @staticmethod
    def _fetch(work: Path, name: str, lim: Limits) -> dict[str, bytes]:
        path = work / _safe_name(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return {}
        with os.fdopen(fd, "rb") as f:
            return {name: f.read(lim.max_file_mb << 20)}


def with_limits(base: Limits, *, wall_s: float | None = None, memory_mb: int | None = None) -> Limits:
    """``base`` with a run's own wall time (CPU time follows it) and memory, when given (None / ≤0: keep)."""
    out = base
    if wall_s is not None and wall_s > 0:
        out = replace(out, wall_s=float(wall_s), cpu_s=float(wall_s))
    if memory_mb is not None and memory_mb > 0:
        out = replace(out, memory_mb=int(memory_mb))
    return out
