"""The first process inside a sandbox run (``python3 -I -S -c <this file> IN_FD OUT_FD``; standard library only):
writes the run's files into its size-limited work directory, runs the program, watches the size-limited mounts
fill, and reports after the program exits.

IN_FD: one JSON line ``{"files": [[name, bytes], ...], "fetch": [names], "max_file": bytes, "argv": [...],
"mounts": {limit name: path}}``, then the files' bytes in that order. OUT_FD: one JSON line per fetched file
``{"file": name, "size": n}`` followed by its ``n`` bytes, then ``{"filled": [limit names]}`` (or ``{"error":
message}`` when the files could not be written). Exit status: the program's (128 + N when signal N ended it).
"""

import json
import os
import select
import stat
import sys


def filled(mounts, seen):
    """Add to ``seen`` each limit whose mount has less than 1/64 of its size free."""
    for limit, path in mounts.items():
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        if st.f_bavail * 64 < st.f_blocks:
            seen.add(limit)


def write_files(inp, head):
    for name, size in head["files"]:
        path = os.path.join(os.getcwd(), name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            while size > 0:
                chunk = inp.read(min(size, 1 << 20))
                if not chunk:
                    raise OSError(f"{name}: the input ended early")
                f.write(chunk)
                size -= len(chunk)


def fetch(out, name, cap):
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        data = f.read(cap)
    out.write(json.dumps({"file": name, "size": len(data)}).encode() + b"\n" + data)


def main():
    in_fd, out_fd = int(sys.argv[1]), int(sys.argv[2])
    os.set_inheritable(out_fd, False)
    out = os.fdopen(out_fd, "wb")
    with os.fdopen(in_fd, "rb") as inp:
        head = json.loads(inp.readline())
        try:
            write_files(inp, head)
        except OSError as exc:
            out.write(json.dumps({"error": f"writing the run's files failed: {exc}"}).encode() + b"\n")
            out.close()
            os._exit(125)
    seen = set()
    pid = os.fork()
    if pid == 0:
        try:
            os.execv(head["argv"][0], head["argv"])
        finally:
            os._exit(127)
    pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    while True:
        filled(head["mounts"], seen)
        if pidfd is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            select.select([], [], [], 0.05)
        elif select.select([pidfd], [], [], 0.05)[0]:
            status = os.waitpid(pid, 0)[1]
            break
    filled(head["mounts"], seen)
    for name in head["fetch"]:
        fetch(out, name, head["max_file"])
    out.write(json.dumps({"filled": sorted(seen)}).encode() + b"\n")
    out.close()
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
