"""The code sandbox against hostile programs: each is stopped or refused, nothing outlives it, the host is unaffected.

Needs bubblewrap (Debian ``bubblewrap``; .ci/run installs it): without it the isolation tests skip and say why,
and the unisolated fallback is tested on its own (docs/code-rl.md records what each test observed).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import threading
import time

import pytest

from livelora.clients.sandbox import IsolationUnavailableError, Limits, Sandbox

pytestmark = pytest.mark.unit

LIMITS = Limits(wall_s=3.0, cpu_s=30.0, memory_mb=256, max_processes=16, max_output_bytes=10_000)


@pytest.fixture(scope="module")
def box() -> Sandbox:
    try:
        return Sandbox(LIMITS, require_isolation=True)
    except IsolationUnavailableError as exc:
        pytest.skip(f"no isolation here: {exc}")


def _host_processes_with(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def test_a_program_gets_its_files_and_stdin_and_returns_files(box):
    code = "import sys\nn = int(open('data/n.txt').read())\nprint(n + int(sys.stdin.read()))\n"
    code += "open('out.txt', 'w').write('ok')"
    r = box.run(code, files={"data/n.txt": b"40"}, stdin="2", fetch_files=["out.txt", "missing.txt"])
    assert (r.status, r.exit_code, r.stdout, r.isolated) == ("finished", 0, "42\n", True)
    assert r.files == {"out.txt": b"ok"}
    failing = box.run("import sys; print('no', file=sys.stderr); sys.exit(3)")
    assert (failing.status, failing.exit_code, failing.stderr, failing.ok) == ("finished", 3, "no\n", False)


def test_file_names_outside_the_work_directory_are_refused(box):
    for name in ("../x.py", "/etc/x", ""):
        with pytest.raises(ValueError, match="relative path"):
            box.run("pass", files={name: b""})


def test_infinite_loop_is_stopped_at_the_wall_limit(box):
    r = box.run("while True:\n    pass")
    assert (r.status, r.exit_code) == ("timeout", None)
    assert 3.0 <= r.wall_s < 15.0


def test_cpu_time_limit_kills_a_busy_program(box):
    r = box.run("while True:\n    pass", limits=Limits(wall_s=60.0, cpu_s=1.0))
    assert r.status == "finished" and r.exit_code in (128 + 24, -24), r  # SIGXCPU
    assert "SIGXCPU" in r.message


def test_fork_bomb_is_capped_and_leaves_nothing(box):
    code = textwrap.dedent(
        """
        import os, time
        children = 0
        while True:
            try:
                if os.fork() == 0:
                    time.sleep(1000.0123)
                    os._exit(0)
                children += 1
            except OSError:
                print(children, flush=True)
                time.sleep(1000.0123)
        """
    )
    r = box.run(code)
    assert r.status == "timeout"
    assert 0 < int(r.stdout.split()[0]) < LIMITS.max_processes  # fork failed at the process limit
    assert _host_processes_with("__sandbox_main__") == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_memory_hog_gets_memory_error(box):
    r = box.run("x = bytearray(1 << 30)\nprint('allocated')")
    assert (r.status, r.exit_code, r.stdout) == ("finished", 1, "")
    assert r.stderr.rstrip().endswith("MemoryError")


def test_network_is_unreachable(box):
    with socket.create_server(("127.0.0.1", 0)) as listener:  # a port of the host's own, not a service's
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # it answers the host
        code = textwrap.dedent(
            f"""
            import socket
            for addr in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
                try:
                    socket.create_connection(addr, timeout=2)
                    print(addr, "connected")
                except OSError as exc:
                    print(addr, type(exc).__name__, exc.errno)
            """
        )
        r = box.run(code)
    lines = r.stdout.splitlines()
    assert lines == [f"('127.0.0.1', {port}) ConnectionRefusedError 111", "('1.1.1.1', 53) OSError 101"], r


def test_writing_outside_its_directory_fails(box, tmp_path):
    target = tmp_path / "escape.txt"
    code = textwrap.dedent(
        f"""
        for path in [{str(target)!r}, "/usr/escape.txt", "/etc/passwd", "/dev/big"]:
            try:
                open(path, "w").write("pwned")
                print(path, "written")
            except OSError as exc:
                print(path, type(exc).__name__)
        """
    )
    r = box.run(code)
    assert r.stdout.splitlines() == [
        f"{target} FileNotFoundError",
        "/usr/escape.txt OSError",
        "/etc/passwd OSError",  # read-only file system (the sandbox's root)
        "/dev/big OSError",  # /dev's tmpfs has no size limit: read-only
    ], r
    assert not target.exists() and not os.path.exists("/usr/escape.txt")


def test_the_servers_files_are_invisible(box, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text("sk-secret-1234")
    home = os.environ.get("LIVELORA_HOME", os.path.expanduser("~/.cache/livelora"))
    code = textwrap.dedent(
        f"""
        import os
        for path in [{str(keys)!r}, {home!r}, "/root", "/home", "/etc/shadow", "/proc/1/environ"]:
            try:
                print(path, "READ", open(path).read() if os.path.isfile(path) else os.listdir(path))
            except OSError as exc:
                print(path, type(exc).__name__)
        """
    )
    r = box.run(code)
    assert "sk-secret" not in r.stdout
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert out[str(keys)] == out[home] == out["/root"] == out["/etc/shadow"] == "FileNotFoundError", r
    assert "LIVELORA" not in out["/proc/1/environ"]  # its own PID namespace: pid 1 is the sandbox's


def test_huge_output_is_cut_at_the_limit(box):
    r = box.run("while True:\n    print('x' * 1000)")
    assert r.status == "output_limit" and len(r.stdout) == LIMITS.max_output_bytes
    assert r.wall_s < LIMITS.wall_s


def test_children_of_a_program_past_the_wall_limit_are_gone(box):
    code = textwrap.dedent(
        """
        import os, subprocess, time
        subprocess.Popen(["python3", "-c", "import time; time.sleep(987.6543)"])
        if os.fork() == 0:  # a daemon: own session, parent gone
            os.setsid()
            if os.fork() == 0:
                time.sleep(987.6543)
            os._exit(0)
        print("spawned", flush=True)
        time.sleep(987.6543)
        """
    )
    r = box.run(code)
    assert (r.status, r.stdout) == ("timeout", "spawned\n")
    assert _host_processes_with("987.6543") == []


def test_without_bubblewrap_it_warns_or_refuses(monkeypatch, caplog):
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "bwrap" else real_which(name))
    with pytest.raises(IsolationUnavailableError, match="not installed"):
        Sandbox(LIMITS, require_isolation=True)
    with caplog.at_level(logging.WARNING, logger="livelora.sandbox"):
        loose = Sandbox(LIMITS)
    assert not loose.isolated and "SANDBOX NOT ISOLATED" in caplog.text
    r = loose.run("import subprocess, time\nsubprocess.Popen(['sleep', '987.6544'])\nprint('hi')")
    assert (r.status, r.exit_code, r.stdout, r.isolated) == ("finished", 0, "hi\n", False)
    assert _host_processes_with("987.6544") == []  # its children die with it (same session)
    hog = loose.run("x = bytearray(1 << 30)")
    assert hog.stderr.rstrip().endswith("MemoryError")


def test_cleanup_does_not_wait_for_zombies():
    # bwrap exits without reaping its namespace's init: the zombie is dead, and the host's PID 1 reaps it later
    from livelora.clients.sandbox.runner import _zombie

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        for _ in range(3000):  # until the exited child shows as a zombie (not yet reaped); 30 s at most under load
            if _zombie(str(pid)):
                break
            time.sleep(0.01)
        assert _zombie(str(pid)) and not _zombie(str(os.getpid()))
    finally:
        os.waitpid(pid, 0)


#: Writes 64 x 16 MiB files (1 GiB) into each directory of argv until one fails, printing the count of whole
#: files and the error; keeps the files 1 s (so that the host's memory can be sampled meanwhile).
FILL = textwrap.dedent(
    """
    import errno, os, sys, time
    for d in sys.argv[1:]:
        n = 0
        try:
            for i in range(64):
                with open(os.path.join(d, f"fill{i}"), "wb") as f:
                    f.write(b"x" * (16 << 20))
                n += 1
                print(d, n, flush=True)
            print(d, n, "done")
        except OSError as exc:
            print(d, n, errno.errorcode[exc.errno], flush=True)
    time.sleep(1)
    """
)


def _shmem_bytes() -> int:
    """The host's shared memory (tmpfs and shm pages, ``Shmem`` of /proc/meminfo) in bytes."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("Shmem:"))


def _fill_run(box: Sandbox, dirs: list[str], limits: Limits):
    """Run FILL on ``dirs``; return ``(result, the largest growth of host shared memory during the run, of
    host /dev/shm's used bytes, of the host temp file system's used bytes)``."""
    code = f"import sys\nsys.argv[1:] = {dirs!r}\n" + FILL
    probes = [_shmem_bytes, lambda: shutil.disk_usage("/dev/shm").used, lambda: shutil.disk_usage("/tmp").used]
    base = [p() for p in probes]
    peak = list(base)
    done: list = []
    worker = threading.Thread(target=lambda: done.append(box.run(code, limits=limits)))
    worker.start()
    while worker.is_alive():
        peak = [max(m, p()) for m, p in zip(peak, probes, strict=True)]
        time.sleep(0.02)
    worker.join()
    return done[0], *(m - b for m, b in zip(peak, base, strict=True))


FILL_LIMITS = Limits(wall_s=60.0, cpu_s=60.0, memory_mb=256, max_processes=16)  # default sizes: 64/256/64 MiB


def test_dev_shm_is_private_and_capped(box):
    marker = tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="livelora-host-")
    with marker:
        r = box.run("import os\nprint(os.listdir('/dev/shm'))")
        assert r.stdout == "[]\n", r  # not the host's /dev/shm
        r, shmem, dev_shm, _ = _fill_run(box, ["/dev/shm"], FILL_LIMITS)
    assert (r.status, r.exit_code) == ("finished", 0), r
    assert r.stdout.splitlines()[-1] == "/dev/shm 4 ENOSPC", r.stdout  # 64 MiB: the 5th file of 16 MiB fails
    assert r.filled == ["shm_mb"] and "/dev/shm full (shm_mb 64 MiB)" in r.message, r
    assert dev_shm < 16 << 20  # the host's /dev/shm did not grow (what else runs here may add a little)
    assert shmem < 256 << 20, shmem  # host shared memory grew by the run's 64 MiB at most (1 GiB without the cap)


def test_work_directory_and_tmp_are_capped(box):
    r, shmem, _, host_tmp = _fill_run(box, [".", "/tmp"], FILL_LIMITS)
    assert (r.status, r.exit_code) == ("finished", 0), r
    lines = [line for line in r.stdout.splitlines() if "ENOSPC" in line or "done" in line]
    assert lines == [". 15 ENOSPC", "/tmp 4 ENOSPC"], r.stdout  # 256 MiB less the program's page; 64 MiB
    assert r.filled == ["work_mb", "tmp_mb"], r
    assert "work directory full (work_mb 256 MiB)" in r.message and "/tmp full (tmp_mb 64 MiB)" in r.message
    assert host_tmp < 512 << 20, host_tmp  # not on the host's disk (1 GiB there without the cap; others write too)
    assert shmem < (256 + 64 + 192) << 20, shmem  # in RAM, within the two tmpfs sizes


def test_files_given_are_counted_against_the_limits(box):
    small = Limits(work_mb=1, max_file_mb=1)
    with pytest.raises(ValueError, match="over max_file_mb 1 MiB"):
        box.run("pass", files={"big.bin": b"x" * ((1 << 20) + 1)}, limits=small)
    with pytest.raises(ValueError, match="over the work directory's work_mb 1 MiB"):
        box.run("pass", files={f"f{i}": b"x" * 4096 for i in range(256)}, limits=small)
    r = box.run("import os\nprint(sum(os.path.getsize(f) for f in os.listdir('.')))", files={"a": b"x" * 900_000})
    assert r.ok and int(r.stdout) > 900_000, r


def test_without_bubblewrap_the_work_directory_total_is_watched(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "bwrap" else real_which(name))
    loose = Sandbox(LIMITS)
    code = "import sys\nsys.argv[1:] = ['.']\n" + FILL
    r = loose.run(code, limits=Limits(wall_s=60.0, cpu_s=60.0, memory_mb=256, work_mb=32))
    assert (r.status, r.exit_code, r.filled) == ("disk_limit", None, ["work_mb"]), r
    assert "over work_mb 32 MiB" in r.message
    written = int(r.stdout.split()[-1]) if r.stdout else 0
    # stopped at its 32 MiB (the 2nd file plus the program passes it, so the kill can come before the 2nd print)
    assert 1 <= written < 64, r.stdout
