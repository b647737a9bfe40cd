"""dflashctl shell: an interactive shell in the container, in the run's environment."""

from __future__ import annotations

import typer

from dflashctl.commands.common import ConfigOption
from dflashctl.commands.exec import NodeOption


def shell(config: ConfigOption = None, node: NodeOption = None) -> None:
    """Open an interactive shell in the container, in the run's environment.

    A pty through SSH and pct exec, in the same environment as `dflashctl exec`;
    exits with the shell's status."""
    import os

    from dflashctl.config.schema import load_config
    from dflashctl.errors import UsageError
    from dflashctl.ops.attach import SHELL, pick_node, run_attached
    from dflashctl.remote.connect import as_host_error
    from dflashctl.remote.nodes import node_sessions

    cfg = load_config(config)  # its mistakes first
    if not os.isatty(0):
        # A shell fed from a file or /dev/null would sit at its prompt on the pty
        # forever: the pty there never sees this side's end of input.
        raise UsageError(
            "shell needs a terminal on its stdin",
            hint="to run commands from a script: dflashctl exec -- sh -c '...' (or -- sh < file)",
        )
    with node_sessions(cfg) as nodes:
        chosen = pick_node(nodes, node)
        with as_host_error(chosen.target):
            status = run_attached(chosen.config, chosen.target, list(SHELL), tty=True)
    raise typer.Exit(status)


def register(app: typer.Typer) -> None:
    app.command()(shell)
