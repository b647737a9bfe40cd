"""The runs of every node as `runs` shows them (dflashctl/runs/view.py)."""

from __future__ import annotations

from dflashctl.remote.nodes import NodeOutcome
from dflashctl.runs.records import PruneResult, RunInfo, RunState
from dflashctl.runs.view import combined, continues, grouped_rows
from tests.test_node_errors import FakeNode, FakeTarget


def node(name: str) -> FakeNode:
    return FakeNode(name, FakeTarget("this machine"))


def run(run_id: str, *, active: bool = False) -> RunInfo:
    return RunInfo(run_id, RunState("running"), active=active)


def test_a_run_of_several_nodes_is_one_group_and_one_nodes_runs_a_row_each():
    outcomes = [
        NodeOutcome(node("a"), value=[run("1-old"), run("2-shared", active=True)]),
        NodeOutcome(node("b"), value=[run("2-shared", active=True)]),
        NodeOutcome(node("c"), error=OSError("down")),
    ]
    rows = [(cell, name, info.id) for cell, name, info in grouped_rows(outcomes)]
    assert rows == [
        ("  1-old", "a", "1-old"),
        ("* 2-shared", "a", "2-shared"),
        ("", "b", "2-shared"),
    ]
    one = grouped_rows(outcomes[:1])
    assert [cell for cell, _, _ in one] == ["  1-old", "* 2-shared"]


def test_continues_and_combined_prunes():
    def run(meta, started=None):
        return RunInfo("x", RunState("exited", 0), meta=meta, started_at_step=started)

    assert continues(run({})) == "-"
    assert continues(run({"resumed_from": "r1", "resumed_step": 200})) == "r1@200"
    # A finished run handed on: continued only if its trainer said it began past step 0.
    handed = {"resumed_from": "r1", "resumed_step": 200, "resumed_finished": True}
    assert continues(run(handed, started=0)) == "-"
    assert continues(run(handed, started=200)) == "r1@200"
    assert continues(run(handed)) == "r1@200?"
    a = PruneResult([{"id": "x", "bytes": 3}], ["s"], 4, True)  # type: ignore[list-item]
    b = PruneResult([{"id": "y", "bytes": 5}], [], 2, True)  # type: ignore[list-item]
    both = combined([a, b], True)
    assert [r["id"] for r in both.removed] == ["x", "y"] and both.bytes == 8
    assert (both.spared, both.runs, both.dry) == (["s"], 6, True)
