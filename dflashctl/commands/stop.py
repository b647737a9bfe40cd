"""dflashctl stop: stop the active run and hand-started ones (SIGTERM, grace, SIGKILL),
on every node at once."""

from __future__ import annotations

from typing import Annotated

import typer

from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.config.schema import load_config
from dflashctl.errors import UsageError
from dflashctl.ui import terminal


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
    from dflashctl.ops.stop import stop_every_node, stuck_error
    from dflashctl.remote.nodes import error_json, fleet_failure, names_each_node, nobody_answered

    if grace is not None and grace < 0:
        raise UsageError(f"--grace must be 0 or more seconds, got {grace:g}")
    if json_output:
        terminal.set_quiet_stdout(True)
    cfg = load_config(config)
    several = names_each_node(cfg.nodes)
    with terminal.step(
        f"stopping runs on {len(cfg.nodes)} nodes" if several else "stopping runs"
    ) as step:
        results = stop_every_node(cfg, grace_s=grace)
        outcomes = [r.outcome for r in results]
        failure = fleet_failure(outcomes, "stopping runs")
        if failure is not None and nobody_answered(outcomes):
            raise failure
        step["done"] = _done_line(results, several)
    _print_stopped(results, several)
    if json_output:
        entries = [
            {
                "node": r.node,
                "target": r.target,
                "stopped": r.stopped,
                "error": error_json(r.outcome.error),
            }
            for r in results
        ]
        terminal.print_json({"nodes": entries}, command="stop")
    failure = failure or stuck_error(results)
    if failure is not None:
        raise failure


def _done_line(results, several: bool) -> str:
    stopped = sum(len(r.stopped) for r in results)
    if several:
        answered = sum(r.outcome.ok for r in results)
        return f"stopped {stopped} run(s) on {answered} of {len(results)} nodes"
    return f"stopped {stopped} run(s)" if stopped else f"nothing to stop on {results[0].target}"


def _print_stopped(results, several: bool) -> None:
    """A line per stopped process; with several nodes each line names its node, and a
    node that stopped nothing or failed says so."""
    from dflashctl.ops.stop import describe_stopped
    from dflashctl.remote.nodes import error_text

    for result in results:
        prefix = f"{result.node}: " if several else ""
        if several and not result.outcome.ok:
            terminal.info(f"  {prefix}not stopped: {error_text(result.outcome.error)}")
        elif several and not result.stopped:
            terminal.info(f"  {prefix}nothing to stop on {result.target}")
        for item in result.stopped:
            terminal.info(f"  {prefix}{describe_stopped(item)}")


def register(app: typer.Typer) -> None:
    app.command()(stop)
