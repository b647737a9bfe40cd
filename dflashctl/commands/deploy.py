"""dflashctl deploy: sync the trainer, stop stale runs, launch, follow the log."""

from __future__ import annotations

from typing import Annotated

import typer

from dflashctl import terminal
from dflashctl.commands.common import (
    ConfigOption,
    DetachOption,
    FreshOption,
    JsonOption,
    TrainerArgsArgument,
    WaitOption,
)
from dflashctl.config import load_config
from dflashctl.json_output import node_name_of


def deploy(
    trainer_args: TrainerArgsArgument = None,
    config: ConfigOption = None,
    detach: DetachOption = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the plan (files to send, runs to stop, command); change nothing.",
        ),
    ] = False,
    start_container: Annotated[
        bool, typer.Option("--start-container", help="Start the container if it is stopped.")
    ] = False,
    fresh: FreshOption = False,
    wait: WaitOption = False,
    yes: Annotated[
        bool,
        typer.Option(
            "--yes",
            "-y",
            help="Send more than trainer.confirm_above_mb without asking (needed off a terminal).",
        ),
    ] = False,
    json_output: JsonOption = False,
) -> None:
    """Send the changed trainer files, stop stale runs, launch and follow the new run."""
    from dflashctl.deploy import DeployOptions
    from dflashctl.deploy import deploy as run_deploy

    if json_output:
        terminal.set_quiet_stdout(True)
    cfg = load_config(config)
    options = DeployOptions(
        detach=detach,
        dry_run=dry_run,
        start_container=start_container,
        fresh=fresh,
        wait=wait,
        yes=yes,
        extra_args=list(trainer_args or []),
    )
    code, summary = run_deploy(cfg, options)
    if json_output:
        terminal.print_json(summary, command="deploy", node=node_name_of(cfg))
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command(context_settings={"allow_interspersed_args": False})(deploy)
