"""Shell completion of run ids (`logs`, `pull`, `runs show`): the runs of the first
node's workdir, newest first, asked from the container as `dflashctl runs` asks them."""

from __future__ import annotations

from typing import Any


def complete_run_id(ctx: Any, incomplete: str) -> list[str]:
    """The run ids that start with `incomplete`; none when the config or the container
    cannot be read (a completion never prints an error into the command line)."""
    from dflashctl.config.schema import load_config
    from dflashctl.errors import DflashError
    from dflashctl.remote.nodes import node_sessions
    from dflashctl.runs.records import list_runs

    try:
        cfg = load_config(ctx.params.get("config"))
        with node_sessions(cfg) as nodes:
            first = nodes[0]
            found = list_runs(
                first.target, first.config.container.workdir, python=first.config.container.python
            )
    except (DflashError, OSError):
        return []
    return [run.id for run in reversed(found) if run.id.startswith(incomplete)]
