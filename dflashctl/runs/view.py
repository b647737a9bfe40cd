"""The runs of every node as `runs` shows them: each node's list or prune (every node
at once), a run that several nodes share grouped, and its lineage in a word. Data only;
commands/runs.py shows it."""

from __future__ import annotations

from collections.abc import Sequence

from dflashctl.remote.nodes import Node, NodeOutcome, on_every_node
from dflashctl.runs.records import PruneResult, RunInfo, list_runs, prune_runs


def continues(run: RunInfo) -> str:
    """`<run>@<step>` for a run that continued another's training, `-` for step 0 (a
    new training after a finished run included, by the trainer's own start record),
    `<run>@<step>?` while that is not known yet."""
    meta = run.meta
    if not meta.get("resumed_from") or run.continued is False:
        return "-"
    step = meta.get("resumed_step")
    known = "" if run.continued else "?"
    return str(meta["resumed_from"]) + ("" if step is None else f"@{step}") + known


def list_every_node(nodes: Sequence[Node]) -> list[NodeOutcome[list[RunInfo]]]:
    """Every node's runs (with their folders' sizes), or the error that kept it from
    answering."""
    return on_every_node(
        list(nodes),
        lambda node: list_runs(
            node.target,
            node.config.container.workdir,
            python=node.config.container.python,
            sizes=True,
        ),
    )


def prune_every_node(
    nodes: Sequence[Node], keep: int, *, dry: bool, only: dict[str, list[str]] | None = None
) -> list[NodeOutcome[PruneResult]]:
    """`--prune KEEP` on every node (KEEP per node); `only`: node name -> the run ids that
    may go there (exactly the ones a question listed)."""

    def one(node: Node) -> PruneResult:
        return prune_runs(
            node.target,
            node.config.container.workdir,
            keep,
            dry=dry,
            only=None if only is None else only.get(node.name, []),
            python=node.config.container.python,
        )

    return on_every_node(list(nodes), one)


def combined(plans: Sequence[PruneResult], dry: bool) -> PruneResult:
    """Several nodes' prunes as one (for the one question asked before removing)."""
    return PruneResult(
        [r for p in plans for r in p.removed],
        [s for p in plans for s in p.spared],
        sum(p.runs for p in plans),
        dry,
    )


def grouped_rows(outcomes: Sequence[NodeOutcome[list[RunInfo]]]) -> list[tuple[str, str, RunInfo]]:
    """(run cell, node name, run) rows: runs oldest first (ids sort by time), a run
    every node has once, its nodes in the config's order; the id only on its first row,
    marked `* ` when it is the active run."""
    by_id: dict[str, list[tuple[str, RunInfo]]] = {}
    for outcome in outcomes:
        for run in outcome.value or []:
            by_id.setdefault(run.id, []).append((outcome.node.name, run))
    rows = []
    for run_id in sorted(by_id):
        group = by_id[run_id]
        active = any(run.active for _, run in group)
        for index, (node, run) in enumerate(group):
            cell = (("* " if active else "  ") + run_id) if index == 0 else ""
            rows.append((cell, node, run))
    return rows
