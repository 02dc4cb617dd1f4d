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
