"""dflashctl exec: run a command in the container, in the run's environment."""

from __future__ import annotations

from typing import Annotated

import typer

from dflashctl.commands.common import ConfigOption

NodeOption = Annotated[
    str | None,
    typer.Option(
        "--node",
        "-N",
        help="The node to run it on: its name or index (default: the first, rank 0's); "
        "-n still works here (it is --lines in logs).",
        show_default=False,
    ),
]


def exec_command(
    command: Annotated[
        list[str],
        typer.Argument(help="The command and its arguments, after `--`.", metavar="-- CMD..."),
    ],
    config: ConfigOption = None,
    node: NodeOption = None,
) -> None:
    """Run a command in the container, in the run's environment.

    Its venv first on PATH, the workdir as cwd, trainer.env and DFLASH_RUN_ID/DFLASH_RUN_DIR of the
    active run; its output streams here and its exit status is dflashctl's."""
    from dflashctl.config.schema import load_config
    from dflashctl.ops.attach import pick_node, run_attached
    from dflashctl.remote.connect import as_host_error
    from dflashctl.remote.nodes import node_sessions

    cfg = load_config(config)
    with node_sessions(cfg) as nodes:
        chosen = pick_node(nodes, node)
        with as_host_error(chosen.target):
            status = run_attached(chosen.config, chosen.target, list(command), tty=False)
    raise typer.Exit(status)


def register(app: typer.Typer) -> None:
    app.command(
        "exec",
        context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    )(exec_command)
