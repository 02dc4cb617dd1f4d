"""The documentation site builds without a warning: ``mkdocs build --strict`` (mkdocs.yml, docs/; the ``docs``
extra, also in ``dev``), so broken links, missing anchors and pages left out of the nav fail CI."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from _doc_blocks import REPO

pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
pytest.importorskip("material", reason="the docs extra is not installed: pip install -e '.[docs]'")


def test_mkdocs_build_strict_passes(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    index = " ".join(re.sub(r"<[^>]+>", " ", (site / "index.html").read_text()).split())  # text, tags dropped
    # the home page includes the README's walkthrough (pymdownx.snippets), so the two cannot drift apart
    assert "with_raw_response" in index and "livelora endpoints promote prod" in index
    for page in (
        "serving",
        "live-loop",
        "rails",
        "training",
        "recipes",
        "endpoints-and-keys",
        "tenants",
        "operations",
        "scaling-out",
        "vllm",
        "benchmarks",
        "architecture",
        "design",
    ):
        assert (site / page / "index.html").is_file(), page
