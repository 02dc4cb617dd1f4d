"""``livelora serve`` / ``gateway`` with the llama_cpp engine: native code cannot take the server down silently.

Before the port listens, a canary generation with the chosen weights runs in a child process
(:mod:`livelora.gateway.engines.llama_cpp.canary`); a crash refuses the start with its cause and the alternatives.
Then the command runs the server in a child process that inherits the bound socket and that it supervises: a
child killed by a signal (a crash in llama.cpp) is reported with the signal, the build and the alternatives, and
the command exits ``128 + signal``; SIGINT and SIGTERM are passed on (the child drains). The child writes Python's
thread stacks on a fatal signal (faulthandler). The engine itself runs in a child of that child
(:mod:`livelora.gateway.engines.llama_cpp.supervised`), which survives llama.cpp's crashes; this is the outer line,
for a crash in the server's own process. Why: docs/serving.md, "When llama.cpp crashes".
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from rich.console import Console

#: Set in the supervised child: the file descriptor of the socket it serves on (bound by the supervisor).
SERVE_FD_ENV = "LIVELORA_SERVE_FD"
_PARENT_ENV = "LIVELORA_SERVE_SUPERVISOR"

console = Console(stderr=True, soft_wrap=True)  # messages: the terminal wraps them, a log file keeps whole lines


def inherited_socket() -> socket.socket | None:
    """In the supervised child: the socket the supervisor bound; ``None`` elsewhere."""
    fd = os.environ.pop(SERVE_FD_ENV, None)
    return None if fd is None else socket.socket(fileno=int(fd))


def guard_native(settings, sock: socket.socket, command: str, options: dict, log_level: str) -> None:
    """In the supervised child: enable faulthandler, die with the supervisor, return. Otherwise run the canary
    (exit 1 with its message when it fails), then run ``command`` with ``options`` in a supervised child serving
    on ``sock`` and exit with its status (``128 + signal`` and a message when a signal killed it).

    Raises:
        typer.Exit: always, outside the supervised child.
    """
    import typer

    if _PARENT_ENV in os.environ:
        from livelora.cli.trainer_process import _die_with_parent

        _die_with_parent(int(os.environ.pop(_PARENT_ENV)))
        faulthandler.enable(all_threads=True)
        return
    from livelora.core.base_models import BUILTIN_GGUF
    from livelora.gateway.engines.llama_cpp.canary import run_canary

    weights = settings.inference.engine_weights or "f16"
    if settings.model in BUILTIN_GGUF:  # another model: the engine's start refuses it with its own message
        console.print(f"llama_cpp engine: a canary generation with the {weights} weights in a child process ...")
        refusal = run_canary(settings.model, settings.home, weights, settings.inference.engine_threads)
        if refusal is not None:
            console.print(f"[red]error[/]: {refusal.message}")
            raise typer.Exit(1)
    raise typer.Exit(_supervise(sock, command, options, log_level, weights, settings.home))


def _argv(command: str, options: dict, log_level: str) -> list[str]:
    argv = [sys.executable, "-m", "livelora.cli.main", command, "--log-level", log_level]
    for name, value in options.items():
        if value is True:
            argv.append(f"--{name.replace('_', '-')}")
        elif value is not None and value is not False:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def _supervise(sock: socket.socket, command: str, options: dict, log_level: str, weights: str, home) -> int:
    env = {**os.environ, SERVE_FD_ENV: str(sock.fileno()), _PARENT_ENV: str(os.getpid())}
    # a session of its own: a terminal's Ctrl-C reaches the child once, from here, not twice
    proc = subprocess.Popen(
        _argv(command, options, log_level), env=env, pass_fds=(sock.fileno(),), start_new_session=True
    )
    sock.close()
    handlers = {sig: signal.signal(sig, lambda s, _f: proc.send_signal(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if code >= 0:
        return code
    shutil.rmtree(Path(home) / "run" / f"metrics-{proc.pid}", ignore_errors=True)  # the child's, left by the crash
    from livelora.gateway.engines.llama_cpp.canary import crash_advice, native_build, signal_name

    console.print(
        f"[red]error[/]: the serving process (pid {proc.pid}, llama_cpp engine, {weights} weights) was killed by "
        f"{signal_name(code)}: a crash in native code (its Python stacks are above); the requests it held got no "
        f"answer. {native_build()}; {crash_advice(weights)}"
    )
    return 128 - code
