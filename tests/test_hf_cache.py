"""``livelora hf-cache``: the built-in model's tokenizer resolvable offline under its hub id."""

from __future__ import annotations

import os
import subprocess
import sys

from livelora.core.base_models import HUB_IDS
from livelora.core.settings import DEFAULT_MODEL


def test_hf_cache_makes_the_tokenizer_resolvable_offline_by_hub_id(tmp_path, livelora_home, tokenizer):
    cache = tmp_path / "hub"
    env = {**os.environ, "LIVELORA_HOME": str(livelora_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "livelora.cli.main", "hf-cache", "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    hub_id = HUB_IDS[DEFAULT_MODEL]
    assert run.stdout.startswith(f"{hub_id} -> ")
    again = subprocess.run(
        [sys.executable, "-m", "livelora.cli.main", "hf-cache", "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert again.stdout == run.stdout  # same tokenizer, same snapshot
    code = (
        "import sys; from transformers import AutoTokenizer; "
        f"t = AutoTokenizer.from_pretrained({hub_id!r}); print(t.encode('The sky is blue.'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**env, "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "hf")},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(tokenizer.encode("The sky is blue."))
