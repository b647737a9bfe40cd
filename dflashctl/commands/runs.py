"""dflashctl runs: the runs in the workdir and their real state."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from dflashctl import terminal
from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.config import load_config
from dflashctl.errors import UsageError
from dflashctl.json_output import node_name_of
from dflashctl.runs_view import confirm_prune, continues, show_prune_plan

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
    from dflashctl import runs as run_records
    from dflashctl.connect import session

    if ctx.invoked_subcommand is not None:
        return

    if json_output:
        terminal.set_quiet_stdout(True)
    if prune is None and (yes or dry_run):
        raise UsageError("--yes and --dry-run go with --prune KEEP", hint="e.g. --prune 5")
    if prune is not None and prune < 0:
        raise UsageError(f"--prune {prune}: KEEP must be 0 or more (how many runs to keep)")
    cfg = load_config(config)
    if len(cfg.nodes) > 1:
        _on_every_node(cfg, prune, yes=yes, dry_run=dry_run, json_output=json_output)
        return
    if prune is not None:
        _prune(cfg, prune, yes=yes, dry_run=dry_run, json_output=json_output)
        return
    with session(cfg) as target:
        found = run_records.list_runs(
            target, cfg.container.workdir, python=cfg.container.python, sizes=True
        )
        place = target.describe()
    if json_output:
        terminal.print_json(
            {
                "target": place,
                "workdir": cfg.container.workdir,
                "runs": [r.to_json() for r in found],
            },
            command="runs",
            node=node_name_of(cfg),
        )
        return
    if not found:
        terminal.info(f"no runs in {cfg.container.workdir} on {place} yet")
        return
    rows = [
        (
            ("* " if run.active else "  ") + run.id,
            run.release or "-",
            (run.started or "-").replace("T", " ").rstrip("Z"),
            continues(run.meta),
            terminal.human_bytes(run.bytes) if run.bytes is not None else "-",
            run,
        )
        for run in found
    ]
    headers = ("  run", "release", "started (UTC)", "continues", "size", "state")
    if terminal.out.is_terminal:
        from rich.table import Table

        table = Table(title=f"runs in {cfg.container.workdir} on {place}", title_justify="left")
        # On a narrow terminal the release id gives way; run ids and states never do.
        table.add_column(headers[0], no_wrap=True, min_width=22)
        table.add_column(headers[1], no_wrap=True, overflow="ellipsis")
        table.add_column(headers[2], no_wrap=True)
        table.add_column(headers[3], no_wrap=True)
        table.add_column(headers[4], no_wrap=True, justify="right")
        table.add_column(headers[5], no_wrap=True, min_width=17)
        for run_id, release, started, lineage, size, run in rows:
            state = run.state
            style = _STYLES.get(state.status, "red")
            if (state.status == "exited" and not state.ok) or run.hanging:
                style = "red"
            if run.clean_stop:  # stopped as asked, whatever the exit status
                style = _STYLES["stopped"]
            table.add_row(
                run_id,
                release,
                started,
                lineage,
                size,
                f"[{style}]{escape(run.describe_state())}[/{style}]",
            )
        terminal.out.print(table)
    else:
        # Plain aligned columns off a terminal: nothing is cut short or wrapped.
        lines = [headers] + [(*cells, run.describe_state()) for *cells, run in rows]
        widths = [max(len(line[i]) for line in lines) for i in range(5)]
        for line in lines:
            cells = [cell.ljust(width) for cell, width in zip(line[:5], widths, strict=True)]
            terminal.out.print("  ".join([*cells, line[5]]), markup=False)
    terminal.info("* the active run (launched last)")


_STYLES = {"running": "cyan", "exited": "green", "stopped": "yellow"}


def _on_every_node(cfg, prune: int | None, *, yes: bool, dry_run: bool, json_output: bool) -> None:
    """A multi-node config: every node's runs (or --prune on every node); a node that
    failed is raised after the others were reported."""
    from dflashctl.fleet import runs as fleet_runs

    if prune is None:
        failure = fleet_runs.list_command(cfg, json_output=json_output)
    else:
        failure = fleet_runs.prune_command(
            cfg, prune, yes=yes, dry_run=dry_run, json_output=json_output
        )
    if failure is not None:
        raise failure


def _prune(cfg, keep: int, *, yes: bool, dry_run: bool, json_output: bool) -> None:
    """With --yes or --dry-run, one round trip; otherwise list, confirm, then remove
    exactly the runs that were listed."""
    from dflashctl import runs as run_records
    from dflashctl.connect import session

    workdir, python = cfg.container.workdir, cfg.container.python
    with session(cfg) as target:
        place = target.describe()
        if yes or dry_run:
            plan = run_records.prune_runs(target, workdir, keep, dry=dry_run, python=python)
        else:
            plan = run_records.prune_runs(target, workdir, keep, dry=True, python=python)
            if plan.removed:
                show_prune_plan(plan, place, keep, dry=True)
                if not confirm_prune(plan):
                    terminal.info("nothing removed")
                    return
                ids = [r["id"] for r in plan.removed]
                plan = run_records.prune_runs(
                    target, workdir, keep, dry=False, only=ids, python=python
                )
        show_prune_plan(plan, place, keep, dry=plan.dry)
    if json_output:
        terminal.print_json(
            {
                "target": place,
                "dry_run": plan.dry,
                "removed": plan.removed,
                "bytes": plan.bytes,
                "spared": plan.spared,
            },
            command="runs",
            node=node_name_of(cfg),
        )


def register(app: typer.Typer) -> None:
    from dflashctl.commands import runs_show

    runs_app.command("show")(runs_show.show)
    app.add_typer(runs_app, name="runs")
