"""restart: the current release launched again, in one round trip to the agent, nothing
synced (`stop` is stopping.py)."""

from __future__ import annotations

import time
from typing import Any

from dflashctl import runs, setup_env, terminal
from dflashctl.config import Config
from dflashctl.connect import session
from dflashctl.crash import rules_for
from dflashctl.launching import (
    follow_unless_detached,
    launch_params,
    lineage_summary,
    print_launched,
    report_interrupted,
    source_meta,
    stop_and_launch,
    trainer_command,
)
from dflashctl.nodes import lone_node


def restart(
    config: Config,
    *,
    detach: bool,
    extra_args: list[str] | None = None,
    fresh: bool = False,
    wait: bool = False,
) -> tuple[int, dict[str, Any]]:
    """Stop stale runs and launch the current release again: one round trip, no sync."""
    rules = rules_for(config)  # config mistakes first, before anything is contacted
    if config.multi_node:
        return _restart_nodes(config, rules, detach, extra_args or [], fresh, wait)
    with session(config) as target:
        run_id = runs.new_id()
        command = trainer_command(config, extra_args or [])
        # The provenance of the release: the source as it is here now (restart sends
        # nothing, so this says what the user would deploy, which is usually it).
        meta = dict(source_meta(config), restart=True)
        params = launch_params(
            config, run_id, None, command, meta, fresh=fresh, by="restart", wait=wait
        )
        if setup_env.needs_streaming(config):
            setup_env.run_setup(config, target, None)
        t0 = time.monotonic()
        try:
            with terminal.spinner("stopping stale runs and launching"):
                launched = stop_and_launch(config, target, params)
        except KeyboardInterrupt:
            report_interrupted(config, run_id, float(params["grace_s"]))
            raise
        print_launched(launched, run_id, command, time.monotonic() - t0)
        summary = {
            "release": launched["release"],
            "run_id": run_id,
            "pid": launched["run"]["pid"],
            "runs_stopped": launched["stopped"],
            "command": command,
            **lineage_summary(launched["run"]),
            "target": target.describe(),
        }
        return follow_unless_detached(lone_node(config, target), rules, summary, detach=detach)


def _restart_nodes(config, rules, detach, extra_args, fresh, wait):
    from dflashctl.launch_nodes import restart_nodes
    from dflashctl.nodes import node_sessions

    with node_sessions(config) as nodes:
        meta = dict(source_meta(config), restart=True)
        summary = restart_nodes(
            config, nodes, extra_args=extra_args, fresh=fresh, wait=wait, meta=meta
        )
        return follow_unless_detached(nodes, rules, summary, detach=detach)
