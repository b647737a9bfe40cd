"""The tables of the terminal facade (ui/terminal.py): every table a command shows is
drawn here, as a rich table on a terminal and as plain aligned columns elsewhere.

Commands hand over plain text cells; this module escapes them. The last column is a
state, coloured by the row's style; it never gives way and may wrap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.markup import escape

from dflashctl.ui import terminal


@dataclass(frozen=True)
class Column:
    header: str
    no_wrap: bool = False
    min_width: int | None = None
    overflow: str = "fold"  # "ellipsis": cut short on a narrow terminal
    justify: str = "left"
    narrow_drops: bool = False  # left out on a terminal narrower than the table's `wide`


@dataclass(frozen=True)
class Row:
    cells: Sequence[str]  # one per column, the state last
    style: str | None = None  # the state's colour


def print_table(
    columns: Sequence[Column], rows: Sequence[Row], *, title: str | None = None, wide: int = 0
) -> None:
    """On a terminal a rich table (the columns that `narrow_drops` left out below `wide`
    terminal columns); elsewhere plain aligned columns, nothing cut short or wrapped."""
    out = terminal.out
    if not out.is_terminal:
        _print_plain(columns, rows)
        return
    from rich.table import Table

    shown = [i for i, c in enumerate(columns) if out.width >= wide or not c.narrow_drops]
    table = Table(title=title, title_justify="left")
    for index in shown:
        column = columns[index]
        table.add_column(
            column.header,
            no_wrap=column.no_wrap,
            min_width=column.min_width,
            overflow=column.overflow,  # type: ignore[arg-type]
            justify=column.justify,  # type: ignore[arg-type]
        )
    last = len(columns) - 1
    for row in rows:
        cells = []
        for index in shown:
            text = escape(row.cells[index])
            if index == last and row.style:
                text = f"[{row.style}]{text}[/{row.style}]"
            cells.append(text)
        table.add_row(*cells)
    out.print(table)


def _print_plain(columns: Sequence[Column], rows: Sequence[Row]) -> None:
    lines = [[c.header for c in columns]] + [list(row.cells) for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns) - 1)]
    for line in lines:
        texts = [cell.ljust(width) for cell, width in zip(line[:-1], widths, strict=True)]
        terminal.out.print("  ".join([*texts, line[-1]]), markup=False)


def print_side_by_side(
    title: str, headers: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]]
) -> None:
    """Facts of several things side by side: a label column, then one column per thing
    (`headers`: its title and colour); `rows`: the label, then each thing's value."""
    from rich.table import Table

    table = Table(
        box=None, show_header=True, pad_edge=False, title=escape(title), title_justify="left"
    )
    table.add_column("", style="bold", no_wrap=True)
    for header, colour in headers:
        table.add_column(escape(header), header_style=f"bold {colour}", overflow="fold")
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    terminal.out.print(table)
