"""dflashctl runs: the runs in the workdir and their real state."""

from __future__ import annotations

import json
import sys

import typer
from rich.table import Table

from dflashctl import terminal
from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.config import load_config


def runs(config: ConfigOption = None, json_output: JsonOption = False) -> None:
    """A table of runs: id, release, started, state (running / exited N / killed by SIG)."""
    from dflashctl import runs as run_records
    from dflashctl.deploy import open_target, where

    if json_output:
        terminal.set_quiet_stdout(True)
    cfg = load_config(config)
    target = open_target(cfg)
    try:
        found = run_records.list_runs(target, cfg.container.workdir, python=cfg.container.python)
        place = where(target)
    finally:
        target.transport.close()
    if json_output:
        sys.stdout.write(json.dumps({"target": place, "runs": [r.to_json() for r in found]}) + "\n")
        return
    if not found:
        terminal.info(f"no runs in {cfg.container.workdir} on {place} yet")
        return
    table = Table(title=f"runs in {cfg.container.workdir} on {place}", title_justify="left")
    table.add_column("", min_width=1, no_wrap=True)
    # Ids and times are never cut short, whatever the terminal width.
    for column, width in (("run", 20), ("release", 20), ("started (UTC)", 19), ("pid", 7)):
        table.add_column(column, no_wrap=True, min_width=width)
    table.add_column("state", no_wrap=True, min_width=12)
    for run in found:
        state = run.state.describe()
        style = {"running": "cyan", "exited": "green" if run.state.ok else "red"}.get(
            run.state.status, "red"
        )
        table.add_row(
            "*" if run.active else "",
            run.id,
            run.release or "-",
            (run.started or "-").replace("T", " ").rstrip("Z"),
            str(run.pid or "-"),
            f"[{style}]{state}[/{style}]",
        )
    terminal.out.print(table)
    terminal.info("* the active run (launched last)")


def register(app: typer.Typer) -> None:
    app.command()(runs)
