"""Docs that cannot rot (issue 28): every shell and Python block of the README and the docs pages is either run by
a test (``<!-- run: tests/<file>.py ... -->`` above it, and that test reads the page) or says why not
(``<!-- not run: reason -->``). The install line repeated in the docs equals the README's, which CI runs."""

from __future__ import annotations

import re

from _doc_blocks import EXECUTABLE, REPO, blocks, doc_files


def _executable_blocks():
    return [b for path in doc_files() for b in blocks(path) if b.lang in EXECUTABLE]


def test_every_shell_and_python_block_is_run_by_a_test_or_marked_not_run(capsys):
    run, not_run, unmarked = [], [], []
    for b in _executable_blocks():
        where = f"{b.path}:{b.line}"
        if b.mark.startswith("not run:"):
            assert len(b.mark) > len("not run:") + 8, f"{where}: say why the block is not run"
            not_run.append(where)
        elif m := re.match(r"run: (tests/\S+\.py)", b.mark):
            test_file = REPO / m.group(1)
            assert test_file.is_file(), f"{where}: {m.group(1)} does not exist"
            page = "README.md" if b.path == "README.md" else b.path.removeprefix("docs/")
            assert page in test_file.read_text(), f"{where}: {m.group(1)} never reads {b.path}"
            run.append(where)
        else:
            unmarked.append(where)
    assert not unmarked, f"blocks neither run by a test nor marked '<!-- not run: reason -->': {unmarked}"
    with capsys.disabled():
        print(f"\ndoc blocks: {len(run)} run by tests, {len(not_run)} marked not run")
    assert len(run) >= 6  # the README's install block and its walkthrough at least


def test_install_blocks_in_the_docs_equal_the_readme_lines():
    readme = blocks(REPO / "README.md")[0].code.splitlines()
    for page in ("docs/index.md", "docs/serving.md", "CONTRIBUTING.md"):
        first = blocks(REPO / page)[0]
        assert first.lang == "bash"
        assert set(first.code.splitlines()) <= set(readme), f"{page}: {first.code!r} differs from the README"


def test_readme_is_at_most_10_kb_and_says_first_what_livelora_is():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= 10 * 1024
    # the title, then one paragraph saying what it is (the docs' home page includes it), then the two commands
    first_paragraph = text.split("\n\n")[1].removeprefix("<!-- --8<-- [start:what] -->\n")
    assert first_paragraph.startswith("livelora is a self-hosted, OpenAI-compatible inference gateway")
