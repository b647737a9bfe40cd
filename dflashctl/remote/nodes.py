"""Several nodes: one Target per node, one SSH connection per host, and work done on
every node at once.

    with node_sessions(config) as nodes:              # one Node per `nodes:` entry
        outcomes = on_every_node(nodes, lambda node: ...)
        values = values_or_raise(outcomes)            # or NodesFailed: every node's outcome

A config without `nodes:` is one node, so a command written this way works the same
for one box and for many. Nodes on the same host share its connection (paramiko runs
many channels over one connection, from several threads).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dflashctl.config.schema import Config
from dflashctl.errors import EXIT_HOST, DflashError
from dflashctl.remote.connect import as_host_error
from dflashctl.remote.deploy_target import Target
from dflashctl.remote.transport import Transport, open_transport

T = TypeVar("T")


@dataclass(eq=False)
class Node:
    index: int
    name: str
    config: Config  # the whole config as if it named this node alone (Config.for_node)
    target: Target

    def describe(self) -> str:
        """For messages: "node gpu-b (CT 305 on root@gpu-b)"."""
        return f"node {self.name} ({self.target.describe()})"


def _host_identity(config: Config) -> tuple[Any, ...]:
    host = config.host
    return (host.address, host.port, host.user, host.identity_file, host.proxy_jump)


@contextlib.contextmanager
def node_sessions(config: Config) -> Iterator[list[Node]]:
    """A Node for every node of the config; every connection is closed at the end."""
    transports: dict[tuple[Any, ...], Transport] = {}
    nodes = []
    for index, node_config in enumerate(config.node_configs()):
        key = _host_identity(node_config)
        if key not in transports:
            transports[key] = open_transport(node_config.host)
        target = Target(transports[key], node_config.container.vmid)
        nodes.append(Node(index, config.nodes[index].label(), node_config, target))
    try:
        yield nodes
    finally:
        for transport in transports.values():
            transport.close()


@dataclass
class NodeOutcome(Generic[T]):
    node: Node
    value: T | None = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def on_every_node(nodes: list[Node], work: Callable[[Node], T]) -> list[NodeOutcome[T]]:
    """`work(node)` on every node at once, one thread each (a fleet of one too: one
    path); each node's outcome (its value, or the error it raised, a low-level one
    already as a HostError), in the nodes' order."""

    def one(node: Node) -> NodeOutcome[T]:
        try:
            with as_host_error(node.target):
                return NodeOutcome(node, value=work(node))
        except Exception as exc:  # reported per node by the caller
            return NodeOutcome(node, error=exc)

    pool = ThreadPoolExecutor(max_workers=max(len(nodes), 1), thread_name_prefix="node")
    try:
        return list(pool.map(one, nodes))
    except KeyboardInterrupt:  # Ctrl-C reaches the main thread: leave the work behind
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)


def names_each_node(nodes: Sized) -> bool:
    """Whether what is said about a node names it: only among several (a fleet of one
    reads as the box it is). The one place that asks how many nodes there are, apart
    from the launch command (torchrun's own flags) and the rendezvous."""
    return len(nodes) > 1


def error_json(error: BaseException | None) -> dict[str, Any] | None:
    """A node's failure for --json: its message and hint (None when it answered)."""
    if error is None:
        return None
    hint = error.hint if isinstance(error, DflashError) else None
    return {"message": error_text(error), "hint": hint}


def error_text(error: BaseException | None) -> str:
    if isinstance(error, DflashError):
        return error.message
    return str(error) or type(error).__name__


class NodesFailed(DflashError):
    """Nodes of the fleet failed a step: every node's outcome (`outcomes`), the first
    failure's exit code and hint. Of one node its message is that node's own error's;
    of several, the first failure named with its node (and the others that failed).
    `message` replaces that text; `facts`: more keys of a node's --json entry."""

    def __init__(
        self,
        outcomes: Sequence[NodeOutcome[Any]],
        step: str = "",
        *,
        first: NodeOutcome[Any] | None = None,
        message: str | None = None,
        facts: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.outcomes, self.step, self.facts = list(outcomes), step, facts or {}
        failed = [o for o in self.outcomes if not o.ok]
        first = first or failed[0]
        self.node, self.cause = first.node.name, first.error
        cause = self.cause
        self.exit_code = cause.exit_code if isinstance(cause, DflashError) else EXIT_HOST
        if message is None:
            message = error_text(cause)
            if names_each_node(self.outcomes):
                others = [o.node.name for o in failed if o is not first]
                also = f" (also failed: {', '.join(others)})" if others else ""
                doing = f" {step}" if step else ""
                place = first.node.target.describe()
                message = f"node {first.node.name} ({place}){doing}: {message}{also}"
        hint = cause.hint if isinstance(cause, DflashError) else None
        super().__init__(message, hint=hint)

    def errors(self) -> dict[str, BaseException | None]:
        """Each node's error (None where it answered), by its name."""
        return {o.node.name: o.error for o in self.outcomes}

    def nodes_json(self) -> list[dict[str, Any]]:
        """--json's `nodes` of the error answer: each node, what failed there (and what
        the step says of it, `facts`)."""
        return [
            {"node": o.node.name, **self.facts.get(o.node.name, {}), "error": error_json(o.error)}
            for o in self.outcomes
        ]


def fleet_failure(outcomes: Sequence[NodeOutcome[Any]], step: str = "") -> BaseException | None:
    """The error to raise after the report: None when every node answered, else
    NodesFailed; a bug's own exception (not a DflashError) as it is, its traceback kept."""
    failed = [o for o in outcomes if o.error is not None]
    if not failed:
        return None
    if not isinstance(failed[0].error, DflashError):
        return failed[0].error
    return NodesFailed(outcomes, step)


def values_or_raise(outcomes: list[NodeOutcome[T]], what: str = "") -> list[T]:
    """Every node's value, or NodesFailed (see fleet_failure). `what`: the step, for
    the message ("staging the release")."""
    failure = fleet_failure(outcomes, what)
    if failure is not None:
        raise failure
    return [o.value for o in outcomes]  # type: ignore[misc]


def nobody_answered(outcomes: Sequence[NodeOutcome[Any]]) -> bool:
    """Every node failed: the command answers like one that failed before any node did
    (the error's own --json answer), not with a list of nodes that answered."""
    return all(o.error is not None for o in outcomes)
