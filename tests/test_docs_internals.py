"""The Python examples of the contributors' pages (docs/internals/*.md) run as written, in order per page, on a
fresh store (``home``, the built-in model linked in) and a Redis prefix of their own (``prefix``)."""

from __future__ import annotations

import pytest
from _doc_blocks import REPO, blocks
from harness.bus import REDIS_URL, delete_prefix, new_prefix

PAGES = [
    "internals/core-sharing.md",
    "internals/metering.md",
    "internals/object-ids.md",
    "internals/redis-keys.md",
    "internals/tenancy.md",
    "internals/tokens.md",
]
RUN = [(REPO / "docs" / p, b) for p in PAGES for b in blocks(REPO / "docs" / p) if b.lang == "python"]


def test_every_python_example_of_the_internals_pages_is_run_here():
    pages = sorted((REPO / "docs" / "internals").glob("*.md"))
    python = [(p.name, b.line) for p in pages for b in blocks(p) if b.lang == "python"]
    assert sorted((p.name, b.line) for p, b in RUN) == sorted(python)
    assert all("test_docs_internals" in b.mark for _, b in RUN)


@pytest.mark.parametrize(("page", "block"), RUN, ids=[f"{p.name}:{b.line}" for p, b in RUN])
def test_an_internals_example_runs(page, block, livelora_home, base_ref, tmp_path):
    home = tmp_path / "store"
    home.mkdir()
    (home / "models").symlink_to(livelora_home / "models", target_is_directory=True)
    prefix = new_prefix("docs")
    try:
        exec(compile(block.code, f"{page.name}:{block.line}", "exec"), {"home": home, "prefix": prefix})
    finally:
        delete_prefix(REDIS_URL, prefix)
