"""Run one untrusted Python program: bubblewrap namespaces + rlimits, a wall clock, capped output, full cleanup.

Isolation (docs/code-rl.md has the why and what the hostile-program tests observed): ``bwrap --unshare-all``
(no network, own PID/IPC/UTS/user namespaces), a read-only ``/usr`` (with ``/etc/alternatives`` and
``/etc/ld.so.cache`` for shared libraries), a private work directory (the program's files) at ``/sandbox``, a
size-limited tmpfs for the work directory (``/sandbox``), ``/tmp`` and ``/dev/shm`` each (``/dev`` read-only),
nothing else of the host. :mod:`.launcher` writes the files in and fetches them out. Limits: rlimits set before
``bwrap`` runs (CPU, address space, processes, file size) and a wall clock kept here; on the wall limit, output
limit or exit the whole process tree is killed. Run as root, each run gets its own uid from a pool. Without
bubblewrap: rlimited subprocesses in their own session with a watchdog on the work directory's total (a loud
warning; no network or file-system isolation) or, with ``require_isolation``, a refusal.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Literal

log = logging.getLogger("livelora.sandbox")

Status = Literal["finished", "timeout", "output_limit", "disk_limit", "sandbox_error"]

#: The program's file name in its work directory (the work directory is its cwd and ``sys.path[0]``).
PROGRAM = "__sandbox_main__.py"
INSIDE = "/sandbox"
#: Each size-limited mount inside the sandbox, by its :class:`Limits` field.
MOUNTS = {"work_mb": INSIDE, "tmp_mb": "/tmp", "shm_mb": "/dev/shm"}
_WHAT = {"work_mb": "work directory", "tmp_mb": "/tmp", "shm_mb": "/dev/shm"}
_LAUNCHER = (Path(__file__).with_name("launcher.py")).read_text()
_PAGE = 4096


_POOLS: dict[tuple[int, int], queue.Queue[int]] = {}
_POOLS_LOCK = threading.Lock()


class IsolationUnavailableError(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here, and isolation is required."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits. ``wall_s`` / ``cpu_s``: seconds (CPU rounded up to whole seconds, per process);
    ``memory_mb``: address space per process (MiB); ``max_processes``: processes and threads of the run;
    ``max_output_bytes``: stdout and stderr each (the pipe is cut there); ``max_file_mb``: largest file written;
    ``work_mb``: the work directory's total (files, program, what it writes); ``tmp_mb``, ``shm_mb``: the private
    ``/tmp`` and ``/dev/shm`` (MiB of RAM each, tmpfs; bubblewrap only)."""

    wall_s: float = 10.0
    cpu_s: float = 10.0
    memory_mb: int = 512
    max_processes: int = 32
    max_output_bytes: int = 1_000_000
    max_file_mb: int = 16
    work_mb: int = 256
    tmp_mb: int = 64
    shm_mb: int = 64


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
    filled: list[str] = field(default_factory=list)

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
                pool: queue.Queue[int] = queue.Queue()
                _POOLS[(uid_base, uid_pool)] = pool
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
        behaviour; files are fetched when the program exits by itself). Raises: ValueError for a file name outside
        the work directory, a file over ``max_file_mb`` or files and code over ``work_mb``."""
        lim = limits or self.limits
        names = {str(_safe_name(n)): data for n, data in {**(files or {}), PROGRAM: code.encode()}.items()}
        _check_sizes(names, lim)
        fetch = [str(_safe_name(n)) for n in fetch_files]
        stdin = stdin.encode() if isinstance(stdin, str) else stdin
        uid = self._uids.get() if self._root else os.getuid()
        try:
            if self.isolated:
                result = self._run_isolated(names, fetch, uid, lim, stdin)
            else:
                result = self._run_loose(names, fetch, uid, lim, stdin)
            return result
        finally:
            if self._root:
                self._uids.put(uid)

    def _run_isolated(self, names: dict[str, bytes], fetch: list[str], uid: int, lim: Limits, stdin: bytes):
        head = {
            "files": [[n, len(d)] for n, d in names.items()],
            "fetch": fetch,
            "max_file": lim.max_file_mb << 20,
            "argv": [self.python, "-s", "-B", PROGRAM],
            "mounts": MOUNTS,
        }
        with tempfile.TemporaryFile() as given:
            given.write(json.dumps(head).encode() + b"\n")
            for data in names.values():
                given.write(data)
            given.seek(0)
            report_r, report_w = os.pipe()
            try:
                cmd = [*self._bwrap(lim), self.python, "-I", "-S", "-c", _LAUNCHER, str(given.fileno()), str(report_w)]
                cap = len(fetch) * ((lim.max_file_mb << 20) + 4096) + 65536
                fds = (given.fileno(), report_w)
                result, report = self._execute(cmd, Path("/"), uid, lim, stdin, fds, (report_r, cap, report_w))
            finally:
                os.close(report_r)
        if self._root:
            _end_uid(uid)
        return _with_report(result, report, lim)

    def _run_loose(self, names: dict[str, bytes], fetch: list[str], uid: int, lim: Limits, stdin: bytes):
        work = Path(tempfile.mkdtemp(prefix="livelora-sandbox-"))
        try:
            for name, data in names.items():
                path = work / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            if self._root:
                for p in [work, *work.rglob("*")]:
                    os.chown(p, uid, uid)

            def watch() -> str:
                used = _tree_bytes(work)
                return (
                    f"work directory {used >> 20} MiB, over work_mb {lim.work_mb} MiB"
                    if used > lim.work_mb << 20
                    else ""
                )

            cmd = [self.python, "-s", "-B", PROGRAM]
            result, _ = self._execute(cmd, work, uid, lim, stdin, (), None, watch)
            if result.status == "disk_limit":
                result.filled = ["work_mb"]
            if self._root:
                _end_uid(uid)
            for name in fetch if result.status == "finished" else ():
                result.files.update(_fetch(work, name, lim))
            return result
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _bwrap(self, lim: Limits) -> list[str]:
        sized = lambda limit, path: ["--size", str(getattr(lim, limit) << 20), "--tmpfs", path]  # noqa: E731
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
            *sized("shm_mb", "/dev/shm"),
            "--remount-ro",  # /dev's own tmpfs has no size: nothing may be written there
            "/dev",
            *sized("tmp_mb", "/tmp"),
            *sized("work_mb", INSIDE),
            "--remount-ro",  # the sandbox's own root (its mount points) read-only too: only the sized mounts write
            "/",
            "--chdir",
            INSIDE,
        ]

    def _execute(
        self,
        cmd: list[str],
        cwd: Path,
        uid: int,
        lim: Limits,
        stdin: bytes,
        pass_fds: tuple[int, ...] = (),
        report: tuple[int, int, int] | None = None,
        watch: Callable[[], str] | None = None,
    ) -> tuple[RunResult, bytes]:
        nproc = lim.max_processes + (0 if self._root else _user_processes(uid)) + (report is not None)
        cpu = max(1, math.ceil(lim.cpu_s))

        def limit() -> None:  # in the child, before exec: inherited by bwrap and everything it starts
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            resource.setrlimit(resource.RLIMIT_AS, (lim.memory_mb << 20, lim.memory_mb << 20))
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            resource.setrlimit(resource.RLIMIT_FSIZE, (lim.max_file_mb << 20, lim.max_file_mb << 20))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        env = {"PATH": "/usr/bin:/bin", "HOME": INSIDE if self.isolated else str(cwd), "LANG": "C.UTF-8"}
        t0 = time.monotonic()
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin)
            stdin_file.seek(0)
            try:
                proc = subprocess.Popen(
                    cmd,
                    cwd=cwd,
                    env=env,
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    pass_fds=pass_fds,
                    user=uid if self._root else None,
                    group=uid if self._root else None,
                    extra_groups=[] if self._root else None,
                    preexec_fn=limit,
                )
            except OSError as exc:
                return RunResult("sandbox_error", None, "", "", 0.0, isolated=self.isolated, message=str(exc)), b""
            finally:  # the child holds it now: the report pipe closes when the sandbox's last process exits
                if report is not None:
                    os.close(report[2])
        status, out, err, extra, (wait_status, usage), why = _collect(proc, t0 + lim.wall_s, lim, report, watch)
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        wall = time.monotonic() - t0
        code = proc.returncode if status == "finished" else None
        message = {"timeout": f"wall time limit {lim.wall_s:g} s", "output_limit": "output limit"}.get(status, why)
        sig = -code if code is not None and code < 0 else (code - 128 if code is not None and code > 128 else 0)
        if sig in (signal.SIGXCPU, signal.SIGKILL) and status == "finished":
            message = f"killed by {signal.Signals(sig).name} (CPU time limit {cpu} s or memory)"
        decode = lambda b: b.decode("utf-8", errors="replace")  # noqa: E731
        result = RunResult(
            status, code, decode(out), decode(err), wall, usage.ru_utime + usage.ru_stime, self.isolated, message
        )
        return result, extra


def _check_sizes(names: dict[str, bytes], lim: Limits) -> None:
    """Raises: ValueError for a file over ``max_file_mb`` or files over ``work_mb`` (in tmpfs pages)."""
    for name, data in names.items():
        if len(data) > lim.max_file_mb << 20:
            raise ValueError(f"file {name!r} is {len(data)} bytes, over max_file_mb {lim.max_file_mb} MiB")
    total = sum(-(-len(d) // _PAGE) * _PAGE for d in names.values())
    if total > lim.work_mb << 20:
        raise ValueError(f"files and code take {total} bytes, over the work directory's work_mb {lim.work_mb} MiB")


def _tree_bytes(root: Path) -> int:
    """Bytes allocated under ``root`` (``st_blocks``; symbolic links not followed; entries vanishing meanwhile
    are skipped)."""
    total, todo = 0, [str(root)]
    while todo:
        with contextlib.suppress(OSError), os.scandir(todo.pop()) as entries:
            for e in entries:
                with contextlib.suppress(OSError):
                    total += e.stat(follow_symlinks=False).st_blocks * 512
                    if e.is_dir(follow_symlinks=False):
                        todo.append(e.path)
    return total


def _with_report(result: RunResult, report: bytes, lim: Limits) -> RunResult:
    """``result`` with the launcher's report: fetched files, the size limits filled, or why it failed."""
    pos = 0
    while pos < len(report):
        end = report.find(b"\n", pos)
        try:
            item = json.loads(report[pos:end]) if end >= 0 else None
        except ValueError:
            item = None
        if not isinstance(item, dict):
            break
        pos = end + 1
        if "file" in item:
            size = min(int(item.get("size", 0)), lim.max_file_mb << 20)
            result.files[str(item["file"])] = report[pos : pos + size]
            pos += size
        elif "error" in item:
            return replace(result, status="sandbox_error", exit_code=None, message=str(item["error"]))
        elif "filled" in item:
            result.filled = [m for m in MOUNTS if m in item["filled"]]
    if result.filled:
        full = ", ".join(f"{_WHAT[m]} full ({m} {getattr(lim, m)} MiB)" for m in result.filled)
        result.message = f"{result.message}; {full}" if result.message else full
    return result


def _collect(
    proc: subprocess.Popen, deadline: float, lim: Limits, report: tuple | None, watch
) -> tuple[Status, bytes, bytes, bytes, tuple, str]:
    """Read stdout/stderr (and the launcher's report) until they close, the wall deadline, the output cap or
    ``watch`` naming a reason (checked every 0.05 s); then kill the process group and reap the program (its wait
    status and rusage)."""
    cap = lim.max_output_bytes
    stdout, stderr = proc.stdout, proc.stderr
    assert stdout is not None and stderr is not None  # started with stdout=PIPE, stderr=PIPE
    bufs = {stdout.fileno(): bytearray(), stderr.fileno(): bytearray()}
    caps = dict.fromkeys(bufs, cap)
    if report is not None:
        bufs[report[0]], caps[report[0]] = bytearray(), report[1]
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    status: Status = "finished"
    reaped, why, checked = None, "", 0.0
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                status = "timeout"
                break
            for key, _ in sel.select(min(left, 0.05 if watch else 0.2)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                buf += chunk[: caps[key.fd] + 1 - len(buf)]
                if len(buf) > caps[key.fd]:
                    del buf[caps[key.fd] :]
                    if caps[key.fd] == cap:
                        status = "output_limit"
            if status == "output_limit":
                break
            if watch is not None and time.monotonic() - checked >= 0.05:
                checked = time.monotonic()
                if why := watch():
                    status = "disk_limit"
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
        stdout.close()
        stderr.close()
        if reaped is None:
            reaped = os.wait4(proc.pid, 0)[1:]
    out, err, *extra = bufs.values()
    return status, bytes(out), bytes(err), bytes(extra[0]) if extra else b"", reaped, why


def _fetch(work: Path, name: str, lim: Limits) -> dict[str, bytes]:
    try:
        fd = os.open(work / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as f:
        return {name: f.read(lim.max_file_mb << 20)} if stat.S_ISREG(os.fstat(fd).st_mode) else {}


def with_limits(base: Limits, *, wall_s: float | None = None, memory_mb: int | None = None) -> Limits:
    """``base`` with a run's own wall time (CPU time follows it) and memory, when given (None / ≤0: keep)."""
    out = base
    if wall_s is not None and wall_s > 0:
        out = replace(out, wall_s=float(wall_s), cpu_s=float(wall_s))
    if memory_mb is not None and memory_mb > 0:
        out = replace(out, memory_mb=int(memory_mb))
    return out
