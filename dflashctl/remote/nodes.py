"""Several nodes: one Target per node, one SSH connection per host, and work done on
every node at once.

    with node_sessions(config) as nodes:              # one Node per `nodes:` entry
        outcomes = on_every_node(nodes, lambda node: ...)
        values = values_or_raise(outcomes)            # the first failure, naming its node

A config without `nodes:` is one node, so a command written this way works the same
for one box and for many. Nodes on the same host share its connection (paramiko runs
many channels over one connection, from several threads).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dflashctl.config.schema import Config
from dflashctl.errors import DflashError
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
    """`work(node)` on every node at once; each node's outcome (its value, or the error
    it raised, a low-level one already as a HostError), in the nodes' order."""

    def one(node: Node) -> NodeOutcome[T]:
        try:
            with as_host_error(node.target):
                return NodeOutcome(node, value=work(node))
        except Exception as exc:  # reported per node by the caller
            return NodeOutcome(node, error=exc)

    if len(nodes) == 1:
        return [one(nodes[0])]
    with ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="node") as pool:
        return list(pool.map(one, nodes))


def values_or_raise(outcomes: list[NodeOutcome[T]], what: str = "") -> list[T]:
    """Every node's value, or the first node's error with its node named (and how many
    others failed too). `what`: the step, for the message ("staging the release")."""
    failed = [o for o in outcomes if o.error is not None]
    if not failed:
        return [o.value for o in outcomes]  # type: ignore[misc]
    first = failed[0]
    error = first.error
    if len(outcomes) == 1 or not isinstance(error, DflashError):
        raise error  # type: ignore[misc]
    others = [o.node.name for o in failed[1:]]
    step = f" {what}" if what else ""
    also = f" (also failed: {', '.join(others)})" if others else ""
    error.message = f"{first.node.describe()}{step}: {error.message}{also}"
    error.args = (error.message,)
    raise error
