"""One run across several nodes: a torchrun job, launched on every node at once.

torchrun's static rendezvous: node k runs

    python -m torch.distributed.run --nnodes=N --node-rank=k --nproc-per-node=K \\
        --master-addr=A --master-port=P --rdzv-id=<run id> <entry> <trainer args>

where A is the first node's container address. Static, not c10d: with a fixed node
rank the first node hosts ranks 0..K-1, so rank 0, which writes the checkpoints and
metrics, is always there, and the next deploy continues from the first node's lineage
(the trainer hands rank 0's checkpoint to every rank). Every node gets the same run id:
`logs`, `runs` and `stop` find one run on every node.

Each node's launch is the agent's `launch` verb as on one node (stop the old run, swap
`current`, start): they run in parallel, only once every node has the release. If a
node's launch fails the new run is stopped on the nodes where it started (a torchrun
job missing a node would only wait at its rendezvous), and the error names the node.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

from dflashctl import agent_client, runs, terminal
from dflashctl.agent_messages import LaunchAnswer, LaunchParams
from dflashctl.config import Config
from dflashctl.errors import DflashError, HostError, UsageError
from dflashctl.launching import (
    describe_lineage,
    describe_stopped,
    launch_params,
    lineage_summary,
    report_interrupted,
    stop_and_launch,
    stop_runs,
)
from dflashctl.nodes import Node, on_every_node, values_or_raise
from dflashctl.stop_report import stopped_by_node, with_stops


@dataclass(frozen=True)
class Rendezvous:
    address: str
    port: int
    interfaces: dict[int, str]  # node index -> the interface that reaches `address`

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"


def rendezvous_endpoint(config: Config, nodes: list[Node]) -> Rendezvous:
    """Where every node's torchrun meets the first node's, and the interface each node
    reaches it through: asked before anything is built or stopped, so a node without
    an address or a route changes nothing."""
    address = rendezvous_address(config, nodes[0])

    def route(node: Node) -> str:
        answer = agent_client.call_agent(
            node.target, node.config.container.python, "address", {"toward": address}
        )
        interface = (answer.get("route") or {}).get("interface")
        if not interface:
            raise HostError(
                f"no route to the rendezvous address {address} from inside the container",
                hint="check the container's network, or set torchrun.address to an address "
                "every node reaches the first node's container at",
            )
        return str(interface)

    interfaces = values_or_raise(on_every_node(nodes, route), "finding its way to the rendezvous")
    return Rendezvous(address, config.torchrun.port, dict(enumerate(interfaces)))


def rendezvous_address(config: Config, first: Node) -> str:
    """torchrun.address, else the address of the first node's container on its default
    route (asked from inside it)."""
    if config.torchrun.address:
        return config.torchrun.address
    answer = agent_client.call_agent(
        first.target, first.config.container.python, "address", {}, timeout=60
    )
    address = answer.get("address")
    if not address:
        raise HostError(
            f"{first.describe()} has no network address but loopback: the other nodes "
            "cannot reach its rendezvous",
            hint="give the container a network, or set torchrun.address to an address the "
            "other nodes reach it at",
        )
    return str(address)


def node_command(
    config: Config, node: Node, count: int, where: tuple[str, int], run_id: str, extra: list[str]
) -> list[str]:
    """Node `node`'s launch: its torchrun, then the trainer as on one node."""
    torchrun = config.torchrun
    return [
        node.config.container.python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={count}",
        f"--node-rank={node.index}",
        f"--nproc-per-node={torchrun.nproc_per_node}",
        f"--master-addr={where[0]}",
        f"--master-port={where[1]}",
        f"--rdzv-id={run_id}",
        *torchrun.args,
        config.trainer.entry,
        *config.trainer.args,
        *extra,
    ]


def node_params(
    config: Config,
    nodes: list[Node],
    node: Node,
    run_id: str,
    release: str | None,
    rendezvous: Rendezvous,
    meta: dict[str, Any],
    *,
    extra_args: list[str],
    fresh: bool,
    by: str,
    wait: bool,
) -> LaunchParams:
    node_meta = {
        "name": node.name,
        "rank": node.index,
        "count": len(nodes),
        "names": [n.name for n in nodes],
        "rendezvous": rendezvous.endpoint,
    }
    where = (rendezvous.address, rendezvous.port)
    command = node_command(config, node, len(nodes), where, run_id, extra_args)
    params = launch_params(
        node.config,
        run_id,
        release,
        command,
        dict(meta, node=node_meta),
        # Only the first node continues a checkpoint: rank 0 is there, and the trainer
        # gives every rank what rank 0 resumes from.
        fresh=fresh or node.index > 0,
        by=by,
        wait=wait,
    )
    # What SkyPilot calls SKYPILOT_NODE_RANK and friends, in our names.
    params["env"].update(
        {
            "DFLASH_NODE_NAME": node.name,
            "DFLASH_NODE_RANK": str(node.index),
            "DFLASH_NUM_NODES": str(len(nodes)),
            "DFLASH_RDZV_ENDPOINT": rendezvous.endpoint,
        }
    )
    # gloo binds the address the hostname resolves to, in a container often loopback
    # (127.0.1.1 in /etc/hosts): the other nodes could not connect. Tell it the
    # interface that reaches the rendezvous (unless trainer.env says otherwise).
    params["env"].setdefault("GLOO_SOCKET_IFNAME", rendezvous.interfaces[node.index])
    # Each node's supervisor would restart its own torchrun on its own: not across nodes.
    params["recovery"]["retry"]["max_restarts"] = 0
    return params


def launch_everywhere(
    config: Config,
    nodes: list[Node],
    run_id: str,
    releases: list[str | None],
    rendezvous: Rendezvous,
    meta: dict[str, Any],
    *,
    extra_args: list[str],
    fresh: bool,
    by: str,
    wait: bool,
) -> tuple[list[LaunchAnswer], str, float]:
    """Stop the old run and start this one on every node at once (each node's `launch`
    verb); returns the answers, the rendezvous endpoint and the seconds it took."""
    if config.run.retry.max_restarts and "max_restarts" in config.run.retry.model_fields_set:
        terminal.info(
            "  run.retry is not applied across nodes: a failed run stays failed "
            "(each node would restart its part on its own)"
        )
    params = {
        node.index: node_params(
            config,
            nodes,
            node,
            run_id,
            releases[node.index],
            rendezvous,
            meta,
            extra_args=extra_args,
            fresh=fresh,
            by=by,
            wait=wait,
        )
        for node in nodes
    }
    t0 = time.monotonic()
    try:
        with terminal.spinner(f"stopping stale runs and launching on {len(nodes)} nodes"):
            outcomes = on_every_node(
                nodes, lambda node: stop_and_launch(node.config, node.target, params[node.index])
            )
    except KeyboardInterrupt:
        for node in nodes:
            terminal.warning(f"{node.describe()}:")
            report_interrupted(node.config, run_id, float(params[node.index]["grace_s"]))
        raise
    if not any(not o.ok for o in outcomes):
        return values_or_raise(outcomes, "launching"), rendezvous.endpoint, time.monotonic() - t0
    again = _stop_where_launched(nodes, [o.node for o in outcomes if o.ok], run_id)
    try:
        values_or_raise(outcomes, "launching")
    except DflashError as exc:
        # Said of every node: an old run stopped on one is not undone by another's error.
        exc.message = with_stops(exc.message, stopped_by_node(outcomes, run_id, again))
        exc.args = (exc.message,)
        raise
    raise AssertionError("unreachable: a node failed")  # values_or_raise raised


def _stop_where_launched(nodes: list[Node], launched: list[Node], run_id: str) -> dict[str, bool]:
    """After a node failed to launch: the run that did start elsewhere would only wait at
    the rendezvous for the missing node; stop it (best effort, said per node). Returns
    node name -> stopped."""

    def stop(node: Node) -> None:
        stop_runs(node.config, node.target, 5.0)

    stopped = {}
    for outcome in on_every_node(launched, stop):
        stopped[outcome.node.name] = outcome.ok
        if outcome.ok:
            terminal.warning(f"stopped run {run_id} on {outcome.node.describe()} again")
        else:
            terminal.warning(
                f"could not stop run {run_id} on {outcome.node.describe()}: {outcome.error}; "
                "stop it with `dflashctl stop`"
            )
    return stopped


def print_nodes_launched(
    nodes: list[Node], answers: list[LaunchAnswer], run_id: str, endpoint: str, seconds: float
) -> None:
    for node, answer in zip(nodes, answers, strict=True):
        for item in answer["stopped"]:
            terminal.info(f"  {node.name}: {describe_stopped(item)}")
    pids = ", ".join(f"{n.name} pid {a['run']['pid']}" for n, a in zip(nodes, answers, strict=True))
    terminal.step_done(
        f"launched run {run_id} on {len(nodes)} nodes from release {answers[0]['release']} "
        f"(rendezvous {endpoint}): {pids}",
        seconds,
    )
    terminal.info(f"  {describe_lineage(answers[0]['run'])}")


def nodes_summary(
    nodes: list[Node], answers: list[LaunchAnswer], run_id: str, endpoint: str
) -> dict[str, Any]:
    """The JSON summary's shared part: the run, its lineage (the first node's), and one
    entry per node."""
    return {
        "run_id": run_id,
        "release": answers[0]["release"],
        "rendezvous": endpoint,
        **lineage_summary(answers[0]["run"]),
        "nodes": [
            {
                "node": node.name,
                "node_rank": node.index,
                "target": node.target.describe(),
                "release": answer["release"],
                "pid": answer["run"]["pid"],
                "runs_stopped": answer["stopped"],
            }
            for node, answer in zip(nodes, answers, strict=True)
        ],
    }


def current_releases(nodes: list[Node]) -> list[str]:
    """Every node's current release, which must be one and the same for a restart."""
    from dflashctl.deploy import inspect

    states = values_or_raise(
        on_every_node(nodes, lambda node: inspect(node.config, node.target, may_start=False)),
        "inspecting",
    )
    found = [s.get("release") for s in states]
    missing = [n.name for n, r in zip(nodes, found, strict=True) if not r]
    if missing:
        raise UsageError(
            f"nothing is deployed on {', '.join(missing)} yet",
            hint="run `dflashctl deploy` first: it sends the trainer to every node",
        )
    if len(set(found)) > 1:
        which = ", ".join(f"{n.name}: {r}" for n, r in zip(nodes, found, strict=True))
        raise UsageError(
            f"the nodes have different current releases ({which}); a run across nodes "
            "needs the same trainer on each",
            hint="run `dflashctl deploy`: it brings every node to the same release",
        )
    return cast(list[str], found)


def restart_nodes(
    config: Config,
    nodes: list[Node],
    *,
    extra_args: list[str],
    fresh: bool,
    wait: bool,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """restart across nodes: the current release (the same on every node) launched
    again everywhere; returns the JSON summary."""
    with terminal.step(f"inspecting {len(nodes)} nodes") as step:
        current = current_releases(nodes)
        rendezvous = rendezvous_endpoint(config, nodes)
        step["done"] = f"inspected {len(nodes)} nodes: release {current[0]} on each"
    from dflashctl.setup_env import setup_every_node

    setup_every_node(nodes, list(current))  # a failure stops nothing
    run_id = runs.new_id()
    answers, endpoint, seconds = launch_everywhere(
        config,
        nodes,
        run_id,
        list(current),
        rendezvous,
        meta,
        extra_args=extra_args,
        fresh=fresh,
        by="restart",
        wait=wait,
    )
    print_nodes_launched(nodes, answers, run_id, endpoint, seconds)
    return nodes_summary(nodes, answers, run_id, endpoint)
