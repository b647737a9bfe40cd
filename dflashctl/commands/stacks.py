"""dflashctl stacks: every thread's Python stack of a live run, per rank."""

from __future__ import annotations

from typing import Annotated

import typer

from dflashctl import terminal
from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.errors import UsageError
from dflashctl.json_output import node_name_of


def stacks(
    run_id: Annotated[
        str | None, typer.Argument(help="The run (default: the active run).", show_default=False)
    ] = None,
    config: ConfigOption = None,
    wait: Annotated[
        float,
        typer.Option("--wait", help="Seconds to wait for every rank to answer."),
    ] = 10.0,
    json_output: JsonOption = False,
) -> None:
    """Ask a live run for every thread's stack (each rank under torchrun), and show what
    its hang watchdog and the NCCL flight recorder dumped: where a hanging run is stuck."""
    from dflashctl.config import load_config
    from dflashctl.stacks import ask_stacks, print_answer

    if not wait > 0:
        raise UsageError(f"--wait must be more than 0 seconds, got {wait:g}")
    if json_output:
        terminal.set_quiet_stdout(True)
    cfg = load_config(config)
    answers = []
    if len(cfg.nodes) > 1:
        from dflashctl.nodes import node_sessions

        with node_sessions(cfg) as nodes:
            for node in nodes:
                answer = ask_stacks(node.target, node.config, run_id, wait)
                answer["node"] = node.name
                answers.append(answer)
    else:
        from dflashctl.connect import session

        with session(cfg) as target:
            answers.append(ask_stacks(target, cfg, run_id, wait))
    if json_output:
        terminal.print_json(
            {"nodes": answers} if len(cfg.nodes) > 1 else answers[0],
            command="stacks",
            node=node_name_of(cfg),
        )
        return
    for answer in answers:
        print_answer(answer, answer.get("node"))


def register(app: typer.Typer) -> None:
    app.command()(stacks)
