"""`dflashctl stop` on several nodes: every node's runs stopped at once (SIGTERM, the
grace period, SIGKILL, as on one node). A torchrun job's process group holds torchrun
and its ranks, so each node's ranks get the signal with it."""

from __future__ import annotations

from typing import Any

from dflashctl import terminal
from dflashctl.agent_messages import StopAnswer
from dflashctl.config import Config
from dflashctl.errors import HostError
from dflashctl.fleet.errors import error_json, error_text, first_failure
from dflashctl.launching import describe_stopped, stop_runs
from dflashctl.nodes import Node, node_sessions, on_every_node


def _stop_node(node: Node, grace: float) -> StopAnswer:
    return stop_runs(node.config, node.target, grace)


def stop_every_node(
    config: Config, *, grace_s: float | None = None
) -> tuple[dict[str, Any], BaseException | None]:
    """Stop the runs on every node at once; one line per node. A node that cannot be
    reached does not keep the others from being stopped: the error returned with the
    summary (for the caller to raise after its --json) names it."""
    grace = config.run.stop_grace_s if grace_s is None else grace_s
    with node_sessions(config) as nodes:
        with terminal.step(f"stopping runs on {len(nodes)} nodes") as step:
            outcomes = on_every_node(nodes, lambda node: _stop_node(node, grace))
            stopped = sum(len(o.value["stopped"]) for o in outcomes if o.value)
            failed = sum(not o.ok for o in outcomes)
            step["done"] = (
                f"stopped {stopped} run(s) on {len(nodes) - failed} of {len(nodes)} nodes"
            )
        report = []
        for outcome in outcomes:
            node = outcome.node
            answer = outcome.value
            if answer is None:
                terminal.info(f"  {node.name}: not stopped: {error_text(outcome.error)}")
            elif not answer["stopped"]:
                terminal.info(f"  {node.name}: nothing to stop on {node.target.describe()}")
            for item in (answer or {}).get("stopped", []):
                terminal.info(f"  {node.name}: {describe_stopped(item)}")
            report.append(
                {
                    "node": node.name,
                    "target": node.target.describe(),
                    "stopped": answer["stopped"] if answer else [],
                    "error": error_json(outcome.error),
                }
            )
    failure = first_failure(outcomes, "stopping runs")
    stuck = [o.node.name for o in outcomes if o.value and not o.value.get("all_stopped", True)]
    if failure is None and stuck:
        failure = HostError(
            f"a run did not exit even after SIGKILL on {', '.join(stuck)}",
            hint="check the container with `ps -ef`; the process may be stuck in I/O",
        )
    return {"nodes": report}, failure
