"""Stopping runs: the agent's `stop` on one target, and on every node at once.

`stop`, deploy and restart all stop runs through `stop_runs`; this module stays small
(the agent client and the nodes, nothing of following or launching) so that `stop`
starts quickly. It returns what each node answered and never prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from dflashctl.config.schema import Config
from dflashctl.errors import HostError
from dflashctl.remote import agent_client
from dflashctl.remote.agent_messages import StopAnswer, StoppedProcess
from dflashctl.remote.nodes import NodeOutcome, names_each_node, node_sessions, on_every_node

if TYPE_CHECKING:
    from dflashctl.remote.deploy_target import Target


def process_scope(config: Config) -> str:
    """Where a hand-started trainer may be: anywhere in a container of its own; on a
    machine without one, only under the workdir (other projects share the machine)."""
    return "container" if config.container.vmid is not None else "workdir"


def stop_runs(config: Config, target: Target, grace_s: float) -> StopAnswer:
    """The agent's `stop`: the active run and hand-started trainers (SIGTERM, `grace_s`,
    SIGKILL), in one round trip."""
    params = {
        "workdir": config.container.workdir,
        "entry": config.trainer.entry,
        "scope": process_scope(config),
        "grace_s": grace_s,
    }
    answer = agent_client.call_agent(
        target, config.container.python, "stop", params, timeout=grace_s + 60
    )
    return cast(StopAnswer, answer)


def describe_stopped(stopped: StoppedProcess) -> str:
    who = f"run {stopped['run_id']}" if stopped.get("run_id") else "hand-started process"
    what = f"{who} (pid {stopped['pid']})"
    if stopped.get("kind") == "member":  # e.g. a torchrun rank, in a session of its own
        what = f"run {stopped['run_id']}'s process pid {stopped['pid']} (outside its group)"
    if stopped["ended"] == "terminated":
        how = f"exited after SIGTERM in {stopped.get('seconds', 0):.1f} s"
    elif stopped["ended"] == "killed":
        how = f"killed with SIGKILL after the {stopped.get('seconds', 0):.0f} s grace period"
    else:
        how = stopped["ended"]
    code = stopped.get("exit_code")
    if code is not None:
        how += f", exit code {code}"
    return f"stopped {what}: {how}"


@dataclass
class NodeStop:
    """What `stop` did on one node: its answer, or the error that kept it from one."""

    node: str
    target: str
    outcome: NodeOutcome[StopAnswer]

    @property
    def stopped(self) -> list[StoppedProcess]:
        return list(self.outcome.value["stopped"]) if self.outcome.value else []

    @property
    def stuck(self) -> bool:
        """A run there did not exit even after SIGKILL."""
        answer = self.outcome.value
        return answer is not None and not answer.get("all_stopped", True)


def stop_every_node(config: Config, grace_s: float | None = None) -> list[NodeStop]:
    """Stop the runs on every node at once (a torchrun job's process group holds torchrun
    and its ranks, so each node's ranks get the signal with it). A node that cannot be
    reached does not keep the others from being stopped: its error is in its result."""
    grace = config.run.stop_grace_s if grace_s is None else grace_s
    with node_sessions(config) as nodes:
        outcomes = on_every_node(nodes, lambda node: stop_runs(node.config, node.target, grace))
        return [NodeStop(o.node.name, o.node.target.describe(), o) for o in outcomes]


def stuck_error(results: list[NodeStop]) -> HostError | None:
    """The error for runs that outlived SIGKILL (naming their nodes when there are
    several), or None."""
    stuck = [r.node for r in results if r.stuck]
    if not stuck:
        return None
    where = f" on {', '.join(stuck)}" if names_each_node(results) else ""
    return HostError(
        f"a run did not exit even after SIGKILL{where}",
        hint="check the container with `ps -ef`; the process may be stuck in I/O",
    )
