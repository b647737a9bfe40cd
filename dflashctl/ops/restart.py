"""restart: the current release launched again (on every node, all or nothing), one
round trip to the agent per node, nothing synced (`stop` is stopping.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dflashctl.config.schema import Config
from dflashctl.crash import rules_for
from dflashctl.ops import setup_env
from dflashctl.ops.committing import launch_everywhere
from dflashctl.ops.launch_command import every_launch_params
from dflashctl.ops.launching import (
    config_meta,
    follow_unless_detached,
    git_state,
    import_follower,
    interrupt_said,
    say_every_launch,
    start_line,
    stop_and_launch,
)
from dflashctl.remote.nodes import node_sessions
from dflashctl.reporting import SILENT, Reporter
from dflashctl.runs import records as runs


def restart(
    config: Config,
    *,
    detach: bool,
    extra_args: list[str] | None = None,
    fresh: bool = False,
    wait: bool = False,
    report: Reporter = SILENT,
) -> tuple[int, dict[str, Any]]:
    """Stop stale runs and launch the current release again on every node: one round
    trip per node, no sync. On several nodes the commit barrier also checks that every
    node's current release is the same one."""
    rules = rules_for(config)  # config mistakes first, before anything is contacted
    if not detach or start_line(config) is not None:
        import_follower()
    with node_sessions(config) as nodes:
        run_id = runs.new_id()
        # The provenance of the release: the source as it is here now (restart sends
        # nothing, so this says what the user would deploy, which is usually it).
        meta = {**config_meta(config), **git_state(Path(config.trainer.source)), "restart": True}
        rendezvous, params = every_launch_params(
            config, nodes, run_id, [None] * len(nodes), meta,
            extra_args=extra_args or [], fresh=fresh, by="restart", wait=wait,
        )  # fmt: skip
        setup_env.setup_every_node(nodes, [None] * len(nodes), report)  # a failure stops nothing
        t0 = time.monotonic()
        with interrupt_said(report, nodes, run_id, params):
            with report.busy("stopping stale runs and launching"):
                answers = launch_everywhere(
                    nodes,
                    run_id,
                    lambda n: stop_and_launch(n.config, n.target, params[n.index]),
                    report,
                )
        top, commands = say_every_launch(report, nodes, answers, params, t0)
        entries = [
            {
                "node": node.name,
                "node_rank": node.index,
                "release": answer["release"],
                "pid": answer["run"]["pid"],
                "runs_stopped": answer["stopped"],
                "command": command,
                "target": node.target.describe(),
            }
            for node, answer, command in zip(nodes, answers, commands, strict=True)
        ]
        summary = {
            **top,
            "rendezvous": rendezvous.endpoint if rendezvous is not None else None,
            "nodes": entries,
        }
        return follow_unless_detached(nodes, rules, summary, detach=detach, report=report)
