"""dflashctl stop: stop the active run and hand-started ones (SIGTERM, grace, SIGKILL)."""

from __future__ import annotations

from typing import Annotated

import typer

from dflashctl import terminal
from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.config import load_config
from dflashctl.errors import UsageError
from dflashctl.json_output import node_name_of


def stop(
    config: ConfigOption = None,
    grace: Annotated[
        float | None,
        typer.Option(
            "--grace",
            help="Seconds between SIGTERM and SIGKILL (default: run.stop_grace_s).",
            show_default=False,
        ),
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """Stop the active run and any process running the entry script by hand (on every node)."""
    from dflashctl.stop_restart import stop as run_stop

    if grace is not None and grace < 0:
        raise UsageError(f"--grace must be 0 or more seconds, got {grace:g}")
    if json_output:
        terminal.set_quiet_stdout(True)
    cfg = load_config(config)
    if len(cfg.nodes) > 1:
        from dflashctl.fleet.stop import stop_every_node

        summary, failure = stop_every_node(cfg, grace_s=grace)
    else:
        summary, failure = run_stop(cfg, grace_s=grace), None
    if json_output:
        terminal.print_json(summary, command="stop", node=node_name_of(cfg))
    if failure is not None:
        raise failure


def register(app: typer.Typer) -> None:
    app.command()(stop)
