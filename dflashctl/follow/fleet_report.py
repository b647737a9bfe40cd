"""How a run stands on its fleet once following stopped (FleetResult: each node's
FollowResult or error, the root cause across nodes and its consequences), and the
closing word printed for it. The result and its JSON are the same for one node and
several; only the words differ (nodes.names_each_node): one node says it as report.py
always did, several add each node's line and the root cause."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.markup import escape

from dflashctl import hints
from dflashctl.errors import EXIT_CRASH, EXIT_INTERRUPTED, EXIT_OK
from dflashctl.follow.report import FollowResult, say_outcome
from dflashctl.follow.root_cause import NodeFailure
from dflashctl.remote.nodes import names_each_node
from dflashctl.ui import terminal

# --------------------------------------------------------------------------- results


@dataclass
class NodeFollow:
    """How following one node ended: its FollowResult, or the error that ended it."""

    name: str
    where: str  # "node gpu-b (CT 201 on root@gpu-b:22)"
    result: FollowResult | None = None
    error: BaseException | None = None
    failure: NodeFailure | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"node": self.name, "where": self.where}
        if self.result is not None:
            data.update(self.result.to_json())
        if self.error is not None:
            data["error"] = str(self.error)
            data["exit_code"] = getattr(self.error, "exit_code", 1)
            data["status"] = "unreachable"
        return data


@dataclass
class FleetResult:
    run_id: str
    nodes: list[NodeFollow]
    root_cause: NodeFailure | None = None
    consequences: list[NodeFailure] = field(default_factory=list)
    interrupted: bool = False

    @property
    def status(self) -> str:
        """crashed or hung (any node), unreachable (a node lost), running (following
        stopped early), stopped (by a dflashctl command), finished (every node)."""
        statuses = [n.result.status if n.result else "unreachable" for n in self.nodes]
        for status in ("crashed", "hung", "unreachable", "running", "stopped"):
            if status in statuses:
                return status
        return "finished"

    @property
    def cli_exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        if self.status in ("crashed", "hung"):
            return EXIT_CRASH
        errors = [getattr(n.error, "exit_code", EXIT_CRASH) for n in self.nodes if n.error]
        return max(errors) if errors else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        """schemas/logs.json's object, the same keys for one node and several."""
        data: dict[str, Any] = {
            "run": self.run_id,
            "status": self.status,
            "nodes": [node.to_json() for node in self.nodes],
            "root_cause": None if self.root_cause is None else self.root_cause.to_json(),
            "consequences": [failure.to_json() for failure in self.consequences],
        }
        if self.interrupted:
            data["interrupted"] = True
        return data


# --------------------------------------------------------------------------- the closing word


def report_fleet(result: FleetResult, *, json_mode: bool = False) -> int:
    """Print the closing word (or the JSON object on stdout); return the exit code."""
    run = result.run_id
    several = names_each_node(result.nodes)
    if json_mode:
        terminal.print_json(result.to_json(), command="logs")
    if result.interrupted:
        on = f" on its {len(result.nodes)} nodes" if several else ""
        terminal.info(
            f"stopped following; run {run} keeps running{on}. "
            f"Resume with {hints.command(f'logs -f {run}')}"
        )
    elif not json_mode and several:
        _say_fleet_outcome(result)
    elif not json_mode and result.nodes[0].result is not None:
        say_outcome(result.nodes[0].result)  # (one node's error was said as it came)
    return result.cli_exit_code


def _say_fleet_outcome(result: FleetResult) -> None:
    run = result.run_id
    status = result.status
    if status in ("crashed", "hung"):
        cause = result.root_cause
        said = f": {escape(cause.describe())}" if cause else ""
        terminal.err.print(
            f"[bold red]✗[/bold red] run {run} {status}; root cause (the first failure in "
            f"time){said}",
            soft_wrap=True,
        )
        for failure in result.consequences:
            terminal.info(f"  then {escape(failure.describe())} (a consequence)")
    elif status == "finished":
        terminal.success(f"run {run} finished on all {len(result.nodes)} nodes")
    elif status == "stopped":
        stopped = next(n.result for n in result.nodes if n.result and n.result.status == "stopped")
        from dflashctl.runs.records import describe_stop

        if stopped.stopped is None and stopped.stop:  # type: ignore[union-attr]
            # Asked to stop by a signal from elsewhere; the trainer says how it went.
            terminal.info(f"run {run} {escape(stopped.stop['said'])}")  # type: ignore[union-attr]
        else:
            terminal.info(f"run {run} was {describe_stop(stopped.stopped or {})}")  # type: ignore[union-attr]
    elif status == "running":
        terminal.info(
            f"run {run} is still running; follow it with {hints.command(f'logs -f {run}')}"
        )
    elif status == "unreachable":
        lost = ", ".join(node.name for node in result.nodes if node.error is not None)
        terminal.warning(f"run {run} could not be followed to its end on node {lost}")
    for node in result.nodes:
        terminal.info(f"  {escape(node.name)}  {escape(_node_words(node))}")
    if status == "unreachable":
        terminal.info(
            f"  the run may still be running there; follow it again with "
            f"{hints.command(f'logs -f {run}')}"
        )
    first = result.nodes[0].result
    if first is not None and status not in ("crashed", "hung"):
        for line in first.summary.describe():
            terminal.info(f"  {line}")


def _node_words(node: NodeFollow) -> str:
    """`finished (exit code 0)  /root/dflash/runs/<id> (CT 200 on ...)`."""
    if node.error is not None:
        return f"unreachable: {node.error}"
    result = node.result
    assert result is not None
    if result.status in ("crashed", "hung") and node.failure is not None:
        words = f"{result.status}: {node.failure.what()}"
    elif result.status == "finished":
        words = f"finished (exit code {result.exit_code})"
    elif result.status == "stopped" and result.stop:
        words = result.stop["said"]
    else:
        words = result.status
    return f"{words}  run dir {result.rundir}" if result.rundir else words
