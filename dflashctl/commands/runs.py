"""dflashctl runs: the runs in the workdir and their real state."""

from __future__ import annotations

import typer

from dflashctl import terminal
from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.config import load_config


def runs(config: ConfigOption = None, json_output: JsonOption = False) -> None:
    """A table of runs: id, release, started, state (running / exited N / killed by SIG)."""
    from dflashctl import runs as run_records
    from dflashctl.connect import session

    if json_output:
        terminal.set_quiet_stdout(True)
    cfg = load_config(config)
    with session(cfg) as target:
        found = run_records.list_runs(target, cfg.container.workdir, python=cfg.container.python)
        place = target.describe()
    if json_output:
        terminal.print_json({"target": place, "runs": [r.to_json() for r in found]})
        return
    if not found:
        terminal.info(f"no runs in {cfg.container.workdir} on {place} yet")
        return
    rows = [
        (
            ("* " if run.active else "  ") + run.id,
            run.release or "-",
            (run.started or "-").replace("T", " ").rstrip("Z"),
            run.state,
        )
        for run in found
    ]
    headers = ("  run", "release", "started (UTC)", "state")
    if terminal.out.is_terminal:
        from rich.table import Table

        table = Table(title=f"runs in {cfg.container.workdir} on {place}", title_justify="left")
        # On a narrow terminal the release id gives way; run ids and states never do.
        table.add_column(headers[0], no_wrap=True, min_width=22)
        table.add_column(headers[1], no_wrap=True, overflow="ellipsis")
        table.add_column(headers[2], no_wrap=True)
        table.add_column(headers[3], no_wrap=True, min_width=17)
        for run_id, release, started, state in rows:
            style = _STYLES.get(state.status, "red")
            if state.status == "exited" and not state.ok:
                style = "red"
            table.add_row(run_id, release, started, f"[{style}]{state.describe()}[/{style}]")
        terminal.out.print(table)
    else:
        # Plain aligned columns off a terminal: nothing is cut short or wrapped.
        lines = [headers] + [(a, b, c, d.describe()) for a, b, c, d in rows]
        widths = [max(len(line[i]) for line in lines) for i in range(3)]
        for line in lines:
            cells = [cell.ljust(width) for cell, width in zip(line[:3], widths, strict=True)]
            terminal.out.print("  ".join([*cells, line[3]]), markup=False)
    terminal.info("* the active run (launched last)")


_STYLES = {"running": "cyan", "exited": "green"}


def register(app: typer.Typer) -> None:
    app.command()(runs)
