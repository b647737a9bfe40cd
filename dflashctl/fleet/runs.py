"""`dflashctl runs` on several nodes: every node's runs in one table, a run shared by
nodes (one torchrun job, one run id everywhere) as one group of rows, one per node;
`runs --prune KEEP` on every node."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from dflashctl import runs as run_records
from dflashctl import terminal
from dflashctl.config import Config
from dflashctl.fleet.errors import error_json, error_text, first_failure
from dflashctl.nodes import NodeOutcome, node_sessions, on_every_node
from dflashctl.runs import PruneResult, RunInfo
from dflashctl.runs_view import confirm_prune, continues, show_prune_plan

HEADERS = ("  run", "node", "release", "started (UTC)", "continues", "state")
WIDE_TABLE = 110  # terminal columns: narrower, the table leaves out the start time
_STYLES = {"running": "cyan", "exited": "green", "stopped": "yellow"}


def list_every_node(config: Config) -> list[NodeOutcome[list[RunInfo]]]:
    with node_sessions(config) as nodes:
        return on_every_node(
            nodes,
            lambda node: run_records.list_runs(
                node.target,
                node.config.container.workdir,
                python=node.config.container.python,
                sizes=True,
            ),
        )


def runs_json(outcomes: list[NodeOutcome[list[RunInfo]]]) -> dict[str, Any]:
    return {
        "nodes": [
            {
                "node": o.node.name,
                "target": o.node.target.describe(),
                "workdir": o.node.config.container.workdir,
                "runs": [r.to_json() for r in o.value or []],
                "error": error_json(o.error),
            }
            for o in outcomes
        ]
    }


def grouped_rows(outcomes: list[NodeOutcome[list[RunInfo]]]) -> list[tuple[str, str, RunInfo]]:
    """(run cell, node name, run) rows: runs oldest first (ids sort by time), a run
    every node has once, its nodes in the config's order; the id only on its first row."""
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


def print_runs(config: Config, outcomes: list[NodeOutcome[list[RunInfo]]]) -> None:
    answered = [o for o in outcomes if o.ok]
    for outcome in outcomes:
        if not outcome.ok:
            terminal.info(
                f"{outcome.node.describe()}: its runs could not be listed: "
                f"{error_text(outcome.error)}"
            )
    rows = grouped_rows(outcomes)
    if not rows:
        if answered:
            names = ", ".join(o.node.name for o in answered)
            terminal.info(f"no runs on {names} yet")
        return
    cells = [
        (
            cell,
            node,
            run.release or "-",
            (run.started or "-").replace("T", " ").rstrip("Z"),
            continues(run.meta),
        )
        for cell, node, run in rows
    ]
    if terminal.out.is_terminal:
        from rich.table import Table

        title = f"runs on {len(config.nodes)} nodes"
        table = Table(title=title, title_justify="left")
        # On a narrow terminal the start time goes and the release id gives way; run
        # ids, node names and states never do (a long state wraps).
        wide = terminal.out.width >= WIDE_TABLE
        table.add_column(HEADERS[0], no_wrap=True, min_width=22)
        table.add_column(HEADERS[1], no_wrap=True, min_width=max(len(c[1]) for c in cells))
        table.add_column(HEADERS[2], overflow="ellipsis")
        if wide:
            table.add_column(HEADERS[3], no_wrap=True)
        table.add_column(HEADERS[4], overflow="ellipsis")
        table.add_column(HEADERS[5], min_width=17)
        for texts, (_, _, run) in zip(cells, rows, strict=True):
            style = _STYLES.get(run.state.status, "red")
            if (run.state.status == "exited" and not run.state.ok) or run.hanging:
                style = "red"
            state = f"[{style}]{escape(run.describe_state())}[/{style}]"
            shown = texts if wide else (*texts[:3], texts[4])
            table.add_row(*(escape(t) for t in shown), state)
        terminal.out.print(table)
    else:
        # Plain aligned columns off a terminal: nothing is cut short or wrapped.
        lines = [HEADERS] + [
            (*t, run.describe_state()) for t, (_, _, run) in zip(cells, rows, strict=True)
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(5)]
        for line in lines:
            texts = [cell.ljust(width) for cell, width in zip(line[:5], widths, strict=True)]
            terminal.out.print("  ".join([*texts, line[5]]), markup=False)
    terminal.info("* the active run (launched last); a run of several nodes has a row per node")


def list_command(config: Config, *, json_output: bool) -> BaseException | None:
    """`runs` on a multi-node config; the failure (naming its node) to raise after."""
    outcomes = list_every_node(config)
    if json_output:
        terminal.print_json(runs_json(outcomes), command="runs")
    else:
        print_runs(config, outcomes)
    return first_failure(outcomes, "listing runs")


# --------------------------------------------------------------------------- --prune


def _prune(node, keep: int, *, dry: bool, only: list[str] | None = None) -> PruneResult:
    return run_records.prune_runs(
        node.target,
        node.config.container.workdir,
        keep,
        dry=dry,
        only=only,
        python=node.config.container.python,
    )


def _combined(plans: list[PruneResult], dry: bool) -> PruneResult:
    return PruneResult(
        [r for p in plans for r in p.removed],
        [s for p in plans for s in p.spared],
        sum(p.runs for p in plans),
        dry,
    )


def prune_command(
    config: Config, keep: int, *, yes: bool, dry_run: bool, json_output: bool
) -> BaseException | None:
    """`runs --prune KEEP` on every node (KEEP per node): with --yes or --dry-run one
    round trip each; otherwise every node's list, one question, then exactly the runs
    listed are removed. A node that cannot be reached: the others are still pruned."""
    with node_sessions(config) as nodes:
        places = {n.name: f"{n.name} ({n.target.describe()})" for n in nodes}
        dry = dry_run or not yes
        outcomes = on_every_node(nodes, lambda node: _prune(node, keep, dry=dry))
        if not (yes or dry_run):
            plans = [o.value for o in outcomes if o.value is not None]
            if any(p.removed for p in plans):
                for outcome in outcomes:
                    if outcome.value is not None and outcome.value.removed:
                        show_prune_plan(outcome.value, places[outcome.node.name], keep, dry=True)
                if not confirm_prune(_combined(plans, True)):
                    terminal.info("nothing removed")
                    return first_failure(outcomes, "pruning runs")
                listed = {
                    o.node.name: [r["id"] for r in o.value.removed]
                    for o in outcomes
                    if o.value is not None
                }
                outcomes = on_every_node(
                    nodes,
                    lambda node: _prune(node, keep, dry=False, only=listed.get(node.name, [])),
                )
        for outcome in outcomes:
            if outcome.value is not None:
                show_prune_plan(
                    outcome.value, places[outcome.node.name], keep, dry=outcome.value.dry
                )
            else:
                terminal.info(f"{outcome.node.describe()}: not pruned: {error_text(outcome.error)}")
    if json_output:
        terminal.print_json(
            {
                "nodes": [
                    {
                        "node": o.node.name,
                        "target": places[o.node.name],
                        "dry_run": o.value.dry if o.value else dry,
                        "removed": o.value.removed if o.value else [],
                        "bytes": o.value.bytes if o.value else 0,
                        "spared": o.value.spared if o.value else [],
                        "error": error_json(o.error),
                    }
                    for o in outcomes
                ]
            },
            command="runs",
        )
    return first_failure(outcomes, "pruning runs")
