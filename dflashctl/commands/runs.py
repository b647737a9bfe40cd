"""dflashctl runs: the runs in the workdir and their real state (on several nodes, every
node's, a run they share as a group of rows); `runs --prune KEEP`."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.config.schema import load_config
from dflashctl.errors import UsageError
from dflashctl.ui import terminal

if TYPE_CHECKING:
    from dflashctl.remote.nodes import Node, NodeOutcome
    from dflashctl.runs.records import PruneResult, RunInfo

PruneOption = Annotated[
    int | None,
    typer.Option(
        "--prune",
        metavar="KEEP",
        help="Remove the folders (logs, checkpoints) of ended runs beyond the newest KEEP. "
        "The active run and running ones always stay.",
        show_default=False,
    ),
]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="With --prune: do not ask.")]
DryRunOption = Annotated[
    bool, typer.Option("--dry-run", help="With --prune: only list what would be removed.")
]


runs_app = typer.Typer(
    invoke_without_command=True,
    no_args_is_help=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@runs_app.callback()
def runs(
    ctx: typer.Context,
    config: ConfigOption = None,
    json_output: JsonOption = False,
    prune: PruneOption = None,
    yes: YesOption = False,
    dry_run: DryRunOption = False,
) -> None:
    """A table of runs: id, release, started, where its training started (the run and
    step it continues, or step 0), state (running / exited N / killed by SIG / stopped).

    With --prune KEEP, remove the folders of ended runs beyond the newest KEEP instead.
    `runs show RUN` draws one run's curves. With several nodes: every node's runs, a
    row per node (--prune: on every node)."""
    from dflashctl.remote.nodes import (
        fleet_failure,
        names_each_node,
        nobody_answered,
        node_sessions,
    )
    from dflashctl.runs.view import list_every_node

    if ctx.invoked_subcommand is not None:
        return

    if json_output:
        terminal.set_quiet_stdout(True)
    if prune is None and (yes or dry_run):
        raise UsageError("--yes and --dry-run go with --prune KEEP", hint="e.g. --prune 5")
    if prune is not None and prune < 0:
        raise UsageError(f"--prune {prune}: KEEP must be 0 or more (how many runs to keep)")
    cfg = load_config(config)
    if prune is not None:
        _prune(cfg, prune, yes=yes, dry_run=dry_run, json_output=json_output)
        return
    with node_sessions(cfg) as nodes:
        outcomes = list_every_node(nodes)
    failure = fleet_failure(outcomes, "listing runs")
    if failure is not None and nobody_answered(outcomes):
        raise failure
    if json_output:
        terminal.print_json({"nodes": [_runs_json(o) for o in outcomes]}, command="runs")
    elif names_each_node(outcomes):
        _print_every_node(outcomes)
    else:
        _print_one_node(outcomes[0])
    if failure is not None:
        raise failure


def _runs_json(outcome: NodeOutcome[list[RunInfo]]) -> dict:
    from dflashctl.remote.nodes import error_json

    return {
        "node": outcome.node.name,
        "target": outcome.node.target.describe(),
        "workdir": outcome.node.config.container.workdir,
        "runs": [r.to_json() for r in outcome.value or []],
        "error": error_json(outcome.error),
    }


_STYLES = {"running": "cyan", "exited": "green", "stopped": "yellow"}
# On a terminal narrower than this, the table of several nodes leaves out the start time.
WIDE_TABLE = 110


def _state_style(run: RunInfo) -> str:
    style = _STYLES.get(run.state.status, "red")
    if (run.state.status == "exited" and not run.state.ok) or run.hanging or run.hung:
        style = "red"
    return style


def _started(run: RunInfo) -> str:
    return (run.started or "-").replace("T", " ").rstrip("Z")


def _print_one_node(outcome: NodeOutcome[list[RunInfo]]) -> None:
    from dflashctl.runs.view import continues
    from dflashctl.ui.tables import Column, Row, print_table

    found, place = outcome.value or [], outcome.node.target.describe()
    workdir = outcome.node.config.container.workdir
    if not found:
        terminal.info(f"no runs in {workdir} on {place} yet")
        return
    rows = []
    for run in found:
        style = _STYLES["stopped"] if run.clean_stop else _state_style(run)
        size = terminal.human_bytes(run.bytes) if run.bytes is not None else "-"
        cells = [("* " if run.active else "  ") + run.id, run.release or "-", _started(run)]
        rows.append(Row([*cells, continues(run), size, run.short_state()], style))
    # On a narrow terminal the release id gives way; run ids and states never do.
    columns = [
        Column("  run", no_wrap=True, min_width=22),
        Column("release", no_wrap=True, overflow="ellipsis"),
        Column("started (UTC)", no_wrap=True),
        Column("continues", no_wrap=True),
        Column("size", no_wrap=True, justify="right"),
        Column("state", no_wrap=True, min_width=17),
    ]
    print_table(columns, rows, title=f"runs in {workdir} on {place}")
    terminal.info("* the active run (launched last)")


def _print_every_node(outcomes: list[NodeOutcome[list[RunInfo]]]) -> None:
    from dflashctl.remote.nodes import error_text
    from dflashctl.runs.view import continues, grouped_rows
    from dflashctl.ui.tables import Column, Row, print_table

    for outcome in outcomes:
        if not outcome.ok:
            terminal.info(
                f"{outcome.node.describe()}: its runs could not be listed: "
                f"{error_text(outcome.error)}"
            )
    grouped = grouped_rows(outcomes)
    if not grouped:
        answered = ", ".join(o.node.name for o in outcomes if o.ok)
        terminal.info(f"no runs on {answered} yet")
        return
    rows = [
        Row(
            [
                cell,
                node,
                run.release or "-",
                _started(run),
                continues(run),
                run.short_state(),
            ],
            _state_style(run),
        )
        for cell, node, run in grouped
    ]
    # On a narrow terminal the start time goes and the release id gives way; run ids,
    # node names and states never do (a long state wraps).
    columns = [
        Column("  run", no_wrap=True, min_width=22),
        Column("node", no_wrap=True, min_width=max(len(r.cells[1]) for r in rows)),
        Column("release", overflow="ellipsis"),
        Column("started (UTC)", no_wrap=True, narrow_drops=True),
        Column("continues", overflow="ellipsis"),
        Column("state", min_width=17),
    ]
    print_table(columns, rows, title=f"runs on {len(outcomes)} nodes", wide=WIDE_TABLE)
    terminal.info("* the active run (launched last); a run of several nodes has a row per node")


# --------------------------------------------------------------------------- --prune


def _prune(cfg, keep: int, *, yes: bool, dry_run: bool, json_output: bool) -> None:
    """`--prune KEEP` on every node (KEEP per node): with --yes or --dry-run one round
    trip each; otherwise every node's list, one question, then exactly the runs listed
    are removed. A node that cannot be reached: the others are still pruned."""
    from dflashctl.remote.nodes import (
        error_json,
        error_text,
        fleet_failure,
        nobody_answered,
        node_sessions,
    )
    from dflashctl.runs.view import combined, prune_every_node

    with node_sessions(cfg) as nodes:
        place = _places(nodes)
        dry = dry_run or not yes
        outcomes = prune_every_node(nodes, keep, dry=dry)
        failure = fleet_failure(outcomes, "pruning runs")
        if failure is not None and nobody_answered(outcomes):
            raise failure
        if not (yes or dry_run):
            plans = {o.node.name: o.value for o in outcomes if o.value is not None}
            if any(p.removed for p in plans.values()):
                for name, plan in plans.items():
                    if plan.removed:
                        _show_prune_plan(plan, place[name], keep, dry=True)
                if not _confirm_prune(combined(list(plans.values()), True)):
                    terminal.info("nothing removed")
                    if failure is not None:
                        raise failure
                    return
                listed = {name: [r["id"] for r in p.removed] for name, p in plans.items()}
                outcomes = prune_every_node(nodes, keep, dry=False, only=listed)
                failure = fleet_failure(outcomes, "pruning runs")
    for outcome in outcomes:
        if outcome.value is not None:
            _show_prune_plan(outcome.value, place[outcome.node.name], keep, dry=outcome.value.dry)
        else:
            terminal.info(f"{outcome.node.describe()}: not pruned: {error_text(outcome.error)}")
    if json_output:
        entries = [
            {
                "node": o.node.name,
                "target": place[o.node.name],
                "dry_run": o.value.dry if o.value else dry,
                "removed": o.value.removed if o.value else [],
                "bytes": o.value.bytes if o.value else 0,
                "spared": o.value.spared if o.value else [],
                "error": error_json(o.error),
            }
            for o in outcomes
        ]
        terminal.print_json({"nodes": entries}, command="runs")
    if failure is not None:
        raise failure


def _places(nodes: list[Node]) -> dict[str, str]:
    """What the prune lines call each node: its place, with its name when there are several."""
    from dflashctl.remote.nodes import names_each_node

    if not names_each_node(nodes):
        return {n.name: n.target.describe() for n in nodes}
    return {n.name: f"{n.name} ({n.target.describe()})" for n in nodes}


def _confirm_prune(plan: PruneResult) -> bool:
    if not (sys.stdin.isatty() and terminal.interactive()):
        raise UsageError(
            f"--prune would remove {len(plan.removed)} run folders; nothing was removed",
            hint="add --yes to remove them, or --dry-run to only list them",
        )
    size = terminal.human_bytes(plan.bytes)
    return typer.confirm(f"remove {len(plan.removed)} runs ({size})?", err=True)


def _show_prune_plan(plan: PruneResult, place: str, keep: int, *, dry: bool) -> None:
    """On stderr, like every human line: stdout stays free for --json."""
    if not plan.removed:
        spared = f" ({len(plan.spared)} older ones are active or running)" if plan.spared else ""
        terminal.info(f"nothing to prune: {plan.runs} runs on {place}, keeping {keep}{spared}")
        return
    verb = "would remove" if dry else "removed"
    for run in plan.removed:
        state = run["status"] + (f" {run['exit_code']}" if run.get("exit_code") is not None else "")
        terminal.info(f"  {run['id']}  {state:<10}  {terminal.human_bytes(int(run['bytes']))}")
    total = terminal.human_bytes(plan.bytes)
    message = f"{verb} {len(plan.removed)} of {plan.runs} runs ({total}) on {place}"
    if plan.spared:
        message += f"; kept {len(plan.spared)} older active or running ones"
    (terminal.info if dry else terminal.success)(message)


def register(app: typer.Typer) -> None:
    from dflashctl.commands import runs_show

    runs_app.command("show")(runs_show.show)
    app.add_typer(runs_app, name="runs")
