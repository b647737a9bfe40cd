"""The tables of the terminal facade (dflashctl/ui/tables.py), off a terminal:
plain aligned columns, the last one not padded, nothing cut short."""

from __future__ import annotations

from dflashctl.ui.tables import Column, Row, print_table


def test_plain_columns_off_a_terminal(capsys):
    columns = [Column("node"), Column("where", narrow_drops=True), Column("state")]
    rows = [Row(["gpu-a", "this machine", "running"], "green"), Row(["b", "x", "[lost]"], "red")]
    print_table(columns, rows, title="2 nodes", wide=500)
    assert capsys.readouterr().out.splitlines() == [
        "node   where         state",
        "gpu-a  this machine  running",
        "b      x             [lost]",
    ]
