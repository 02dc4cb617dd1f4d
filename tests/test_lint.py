"""ruff (configured in pyproject.toml) finds nothing to fix and nothing to reformat in the repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert exe, "ruff is a dev extra: pip install -e '.[dev]'"
    return subprocess.run([exe, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")], ids=["check", "format"])
def test_ruff_is_clean(args):
    result = _ruff(*args)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
