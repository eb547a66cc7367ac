"""docs/scale.md's table is `python -m fusedzero.emulate --table`'s output: a few of its rows
are recomputed here (on the meta device, about a second) and must appear in the page verbatim.
The whole table takes minutes: regenerate it with that command when a row changes."""

from __future__ import annotations

from pathlib import Path

from fusedzero.emulate import TABLE_ROWS, table

DOC = Path(__file__).resolve().parents[2] / "docs" / "scale.md"
ROWS = (("llama-8b", 2, (1024,)), ("llama-8b", 3, (1024,)))  # the cheapest rows to build


def test_docs_scale_table_rows_are_the_emulations() -> None:
    for shape, stage, worlds in ROWS:
        assert any(r[:2] == (shape, stage) and set(worlds) <= set(r[2]) for r in TABLE_ROWS)
    doc = DOC.read_text().splitlines()
    for line in table(ROWS).splitlines():
        assert line in doc, (
            f"docs/scale.md lacks {line!r}: regenerate its table with "
            "`python -m fusedzero.emulate --table`"
        )
