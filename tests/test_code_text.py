"""In-code text stays concise: every package module's docstring is at most 15 lines, and no package file cites a
document outside the repository (``tinker_protocol.md``, ``../shared/...``); what such text held lives in
``docs/internals/``. Package folders come from pyproject's ``package-dir`` (:func:`harness.source.package_dirs`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from harness.source import REPO, package_dirs

MAX_MODULE_DOC_LINES = 15
#: A cited document: one of the reference notes the code used to point at, or anything under ``shared/``, with
#: the path written before it. A citation is fine when that path is a file of this repository.
EXTERNAL = re.compile(
    r"[\w./-]*(?:\b(?:tinker_protocol|losses|design|openai_contract|vllm_lora|peers|measurements|distributed"
    r"|sandbox_api|style)\.md\b|\bshared/[\w./-]*)"
)


def package_files() -> list[Path]:
    return sorted(p for folder in package_dirs().values() for p in folder.rglob("*.py"))


def module_doc_lines(source: str) -> int:
    """Lines the module docstring spans in the source (0 when there is none)."""
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            return body[0].end_lineno - body[0].lineno + 1
    return 0


def external_citations(source: str) -> list[tuple[int, str]]:
    """``(line, cited path)`` of every citation in ``source`` of a document that is not a file of the repository."""
    found = []
    for number, line in enumerate(source.splitlines(), 1):
        for match in EXTERNAL.finditer(line):
            cited = match.group(0).rstrip(".,;:")
            if cited.startswith("../") or not (REPO / cited).is_file():
                found.append((number, cited))
    return found


def test_the_checks_see_what_they_are_for():
    assert module_doc_lines('"""One line."""\nx = 1\n') == 1
    assert module_doc_lines('"""A\n\nB\n"""\n') == 4
    assert module_doc_lines("x = 1\n") == 0
    text = 'see ../shared/reference/losses.md §2 and tinker_protocol.md §3\n"""docs/internals/losses.md §2"""'
    assert [c for _, c in external_citations(text)] == ["../shared/reference/losses.md", "tinker_protocol.md"]
    assert (REPO / "docs/internals/losses.md").is_file()


def test_every_package_module_docstring_is_at_most_15_lines():
    files = package_files()
    assert len(files) > 100  # the packages were found
    long = {str(p.relative_to(REPO)): n for p in files if (n := module_doc_lines(p.read_text())) > MAX_MODULE_DOC_LINES}
    listing = "\n".join(f"  {path}: {n} lines" for path, n in sorted(long.items(), key=lambda kv: -kv[1]))
    assert not long, (
        f"{len(long)} module docstrings are over {MAX_MODULE_DOC_LINES} lines (say what the module is for and its "
        f"main entry points; move contracts and reasons to docs/internals/):\n{listing}"
    )


def test_no_package_file_cites_a_document_outside_the_repository():
    cited = {}
    for p in package_files():
        if found := external_citations(p.read_text()):
            cited[str(p.relative_to(REPO))] = found
    listing = "\n".join(f"  {path}:{line}: {what}" for path, found in sorted(cited.items()) for line, what in found)
    assert not cited, (
        f"{len(cited)} package files cite documents that are not in the repository (cite a paper or author, "
        f"or a page under docs/):\n{listing}"
    )
