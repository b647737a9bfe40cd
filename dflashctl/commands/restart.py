"""dflashctl restart: stop stale runs and launch the current release again (no sync)."""

from __future__ import annotations

import typer

from dflashctl.commands.common import (
    ConfigOption,
    DetachOption,
    FreshOption,
    JsonOption,
    TrainerArgsArgument,
    WaitOption,
)
from dflashctl.config.schema import load_config
from dflashctl.ui import terminal


def restart(
    trainer_args: TrainerArgsArgument = None,
    config: ConfigOption = None,
    detach: DetachOption = False,
    fresh: FreshOption = False,
    wait: WaitOption = False,
    json_output: JsonOption = False,
) -> None:
    """Stop stale runs and relaunch the current release; follows unless --detach."""
    from dflashctl.ops.restart import restart as run_restart

    if json_output:
        terminal.set_quiet_stdout(True)
    cfg = load_config(config)
    code, summary = run_restart(
        cfg,
        detach=detach,
        extra_args=list(trainer_args or []),
        fresh=fresh,
        wait=wait,
        report=terminal.TerminalReporter(),
    )
    if json_output:
        terminal.print_json(summary, command="restart")
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command(context_settings={"allow_interspersed_args": False})(restart)
