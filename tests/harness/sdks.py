"""Where the official tinker SDK venvs are (``.ci/setup-tinker-sdks``: ``.venv-tinker038``, ``.venv-tinker024``, or
``LIVELORA_TINKER038_PYTHON`` / ``LIVELORA_TINKER024_PYTHON``). ``.ci/run`` builds them beside the first tests and
marks the build with :data:`BUILDING` until it ends, so a suite that needs one waits for it."""

from __future__ import annotations

import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
#: exists while ``.ci/run`` builds the SDK venvs in the background
BUILDING = ROOT / ".venv-tinker0-building"
#: the longest wait for that build (seconds)
WAIT_S = 1800.0


def sdk_python(version: str) -> Path | None:
    """The python of the venv holding tinker ``version`` ("038" or "024") once any build of it has ended, or None."""
    env = os.environ.get(f"LIVELORA_TINKER{version}_PYTHON")
    if env:
        return Path(env) if Path(env).exists() else None
    deadline = time.monotonic() + WAIT_S
    while BUILDING.exists() and time.monotonic() < deadline:
        time.sleep(2)
    path = ROOT / f".venv-tinker{version}" / "bin" / "python"
    return path if path.exists() else None
