"""The CLI's tables are not cut at 80 columns when written to a pipe or a file (``livelora adapters list | less``,
``> report.txt``); ``COLUMNS`` still sets the width, as in a terminal."""

import io

from rich.table import Table

from livelora.cli.admin_common import PIPED_WIDTH, CliConsole


def _printed(**console) -> list[str]:
    buf = io.StringIO()
    table = Table("name", "description")
    table.add_row("smollm2-135m-instruct@12", "trained on 8 ratings; " + "the evaluation gate passed every check " * 3)
    CliConsole(file=buf, **console).print(table)
    return buf.getvalue().splitlines()


def test_a_table_written_to_a_pipe_keeps_its_rows_whole(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    lines = _printed()
    assert len(lines) == 5 and lines[3].endswith("the evaluation gate passed every check  │")
    assert 80 < max(map(len, lines)) <= PIPED_WIDTH
    monkeypatch.setenv("COLUMNS", "80")
    narrow = _printed()
    assert len(narrow) > 5 and max(map(len, narrow)) <= 80  # wrapped to the width asked for


def test_a_versions_freeform_rows_say_when_the_gate_stopped_early_and_stay_narrow_when_piped(monkeypatch):
    """``adapters show``: a sample cut short is said to be (30 of 60 items, the sequential test decided), the items
    lost and gained are counted and shown, and a long reply is clipped, so piped rows stay narrow."""
    from harness.gate import freeform_summary

    from livelora.cli.gate_rows import freeform_rows

    monkeypatch.delenv("COLUMNS", raising=False)
    reply = "The answer is that " + "the model keeps talking about many things " * 8
    ff = freeform_summary(
        lost=[{"id": "f1", "prompt": "Which metal is liquid at room temperature?", "reply": reply, "was": "Mercury."}],
        gained=[{"id": "f2", "prompt": "What is 7 times 6?", "reply": "42.", "was": "It is 36."}],
        lost_count=4,
        gained_count=1,
    )
    buf = io.StringIO()
    table = Table(title="m@2", show_header=False)
    freeform_rows(table, ff)
    CliConsole(file=buf).print(table)
    text, lines = buf.getvalue(), buf.getvalue().splitlines()
    flat = " ".join(text.split())
    assert (
        "│ free-form │ 12 of 30 items right (current version 15, base model 15) │" in flat
        and "│ sample │ the first 30 of 60 items: the gate's sequential test had decided there │" in flat
        and "│ changes │ 4 lost, 1 gained against the current version │" in flat
    )
    assert "'Which metal is liquid at room temperature?' -> 'The answer is that the model" in flat
    assert reply not in flat and "…' (was 'Mercury.')" in flat
    assert "│ gained │ 'What is 7 times 6?' -> '42.' (was 'It is 36.') │" in flat
    assert max(map(len, lines)) < 200 and len(lines) == 9  # one line per row: nothing wrapped, nothing padded far
    # the whole sample measured: nothing said of stopping
    buf = io.StringIO()
    table = Table(title="m@3", show_header=False)
    freeform_rows(table, ff | {"items": 60, "lost": []})
    CliConsole(file=buf).print(table)
    assert "24 of 60 items right" in buf.getvalue() and "sample" not in buf.getvalue()
