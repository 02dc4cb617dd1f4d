"""A canary generation with llama.cpp in a child process: a native build that crashes on this CPU (a signal) is
found before anything serves or a test run loads it in-process, and named with the CPU flags, the
llama-cpp-python version and the working alternatives (docs/serving.md, "When llama.cpp crashes").

Run as ``python -m livelora.gateway.engines.llama_cpp.canary [WEIGHTS [MODEL [HOME [THREADS]]]]`` (what
:func:`run_canary` starts; defaults ``f16``, the built-in model, ``$LIVELORA_HOME``, all cores): converts the served
file if needed, loads it, prefills two rows, decodes a few steps and exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: CPU flags that choose llama.cpp's kernels (``/proc/cpuinfo``); AMX is the path known to crash (issue 46).
KERNEL_FLAGS = ("amx", "avx512", "avx2", "avx_vnni", "fma", "f16c")
#: The build that runs on every x86-64 CPU with AVX2 (no native tuning, so no AMX kernels).
PORTABLE_BUILD = 'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"'


def cpu_flags() -> list[str]:
    """This CPU's flags among :data:`KERNEL_FLAGS` (prefix match), sorted; empty where ``/proc/cpuinfo`` is not."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return sorted({f for f in line.split(":", 1)[-1].split() if f.startswith(KERNEL_FLAGS)})


def native_build() -> str:
    """``llama-cpp-python X.Y.Z`` (or ``not installed``) and the CPU flags, for messages."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("llama-cpp-python")
    except PackageNotFoundError:
        v = "not installed"
    return f"llama-cpp-python {v}; CPU flags: {' '.join(cpu_flags()) or 'unknown'}"


def signal_name(returncode: int) -> str:
    """``SIGSEGV (signal 11)`` for a process killed by a signal (``returncode < 0``)."""
    try:
        return f"{signal.Signals(-returncode).name} (signal {-returncode})"
    except ValueError:
        return f"signal {-returncode}"


def crash_advice(weights: str) -> str:
    """What to do when llama.cpp crashes serving ``weights``: the other format, a portable build, another engine."""
    other = "serve LIVELORA_ENGINE_WEIGHTS=f16 (float16 weights, other kernels), or " if weights != "f16" else ""
    return (
        f"{other}reinstall llama-cpp-python as a portable build: {PORTABLE_BUILD} pip install --force-reinstall "
        "--no-cache-dir --no-deps llama-cpp-python, or serve with LIVELORA_ENGINE=transformers "
        "(docs/serving.md, 'When llama.cpp crashes')"
    )


@dataclass(frozen=True)
class CanaryFailure:
    """Why the canary did not generate: ``message`` (for the user) and the ``signal`` that killed it (``None``:
    it failed otherwise, an error or a timeout)."""

    message: str
    signal: int | None


def run_canary(
    model: str, home: Path, weights: str, threads: int | None = None, timeout: float = 600
) -> CanaryFailure | None:
    """Run the canary for ``model``'s GGUF served as ``weights`` in a child process; returns ``None`` when it
    generated, else what happened (the signal or the error's last lines, :func:`native_build`,
    :func:`crash_advice`). ``threads``: llama.cpp threads (default all cores); ``timeout`` in seconds."""
    argv = [sys.executable, "-m", __name__, weights, model, str(home), str(threads or os.cpu_count() or 1)]
    what = f"the llama_cpp engine's canary generation ({model}, {weights} weights)"
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return CanaryFailure(f"{what} did not finish in {timeout:.0f} s ({native_build()})", None)
    if proc.returncode == 0:
        return None
    if proc.returncode > 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return CanaryFailure(f"{what} failed in a child process: {tail} ({native_build()})", None)
    return CanaryFailure(
        f"{what} was killed by {signal_name(proc.returncode)} in a child process: llama.cpp's native build crashes "
        f"on this machine ({native_build()}); {crash_advice(weights)}",
        -proc.returncode,
    )


def _canary(model: str, home: Path, weights: str, threads: int) -> None:
    from livelora.core.base_models import gguf_location
    from livelora.gateway.engines.llama_cpp.model import LlamaModel, served_gguf

    gguf = served_gguf(gguf_location(model), weights, home / "models" / "gguf")
    llama = LlamaModel(gguf, n_seq=2, n_ctx_seq=512, n_threads=threads, role="canary")
    prompt = list(range(100, 124))
    llama.decode([(t, pos, row, pos == len(prompt) - 1) for row in (0, 1) for pos, t in enumerate(prompt)])
    pos = [len(prompt), len(prompt)]
    for step in range(4):  # one row, then two: llama.cpp's vector and matrix kernels
        rows = (0,) if step < 2 else (0, 1)
        llama.decode([(200 + step, pos[row], row, True) for row in rows])
        for row in rows:
            pos[row] += 1
    llama.close()


if __name__ == "__main__":
    from livelora.core.settings import DEFAULT_MODEL, default_home

    args = sys.argv[1:] + [None] * 4
    weights, model = args[0] or "f16", args[1] or DEFAULT_MODEL
    home = Path(args[2] or os.environ.get("LIVELORA_HOME") or default_home())
    _canary(model, home, weights, int(args[3] or os.cpu_count() or 1))
    print(f"llama.cpp generated with {model}'s {weights} weights ({native_build()})")
