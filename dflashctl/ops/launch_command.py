"""The launch of a run on each of its nodes: a plain process on one node, torchrun on
several, and the commit every node's launch agrees on first.

Several nodes run as one torchrun job with a static rendezvous: node k runs

    python -m torch.distributed.run --nnodes=N --node-rank=k --nproc-per-node=K \\
        --master-addr=A --master-port=P --rdzv-id=<run id> <entry> <trainer args>

where A is the first node's container address. Static, not c10d: with a fixed node
rank the first node hosts ranks 0..K-1, so rank 0, which writes the checkpoints and
metrics, is always there, and the next deploy continues from the first node's lineage
(the trainer hands rank 0's checkpoint to every rank). Every node gets the same run id.

Every node's launch carries `commit` (dflashctl/agent/commit_barrier.py): built and
checked, nothing stopped yet, the nodes agree at a TCPStore on the first node's
container at torchrun.commit_port (not torchrun.port: the old run's torchrun still
holds that while the nodes decide), so either every node launches or none does.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Sized
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from dflashctl.config.schema import Config
from dflashctl.errors import HostError
from dflashctl.ops import setup_env
from dflashctl.ops.launching import launch_params, trainer_command
from dflashctl.remote import agent_client
from dflashctl.remote.agent_messages import LaunchParams
from dflashctl.remote.nodes import Node, on_every_node, values_or_raise


@dataclass(frozen=True)
class Rendezvous:
    address: str
    port: int
    commit_port: int
    interfaces: dict[int, str]  # node index -> the interface that reaches `address`

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"


def meet(nodes: Sized) -> bool:
    """Whether the nodes meet, at torchrun's rendezvous and the commit barrier before
    it: only several do (one node runs the trainer itself and launches alone)."""
    return len(nodes) > 1


def rendezvous_for(config: Config, nodes: list[Node]) -> Rendezvous | None:
    """Where the nodes meet (None on one node: nothing to meet). Asked before anything
    is built or stopped, so a node without an address or a route changes nothing."""
    if not meet(nodes):
        return None
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
    torchrun = config.torchrun
    return Rendezvous(address, torchrun.port, torchrun.commit_port, dict(enumerate(interfaces)))


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
    config: Config,
    node: Node,
    count: int,
    where: tuple[str, int] | None,
    run_id: str,
    extra: list[str],
) -> list[str]:
    """Node `node`'s launch: the trainer itself on one node; its torchrun, then the
    trainer, on several (`where`: the rendezvous address and port)."""
    if count == 1 or where is None:
        return trainer_command(node.config, extra)
    torchrun = config.torchrun
    return [
        node.config.container.python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={count}",
        f"--node-rank={node.index}",
        f"--nproc-per-node={nproc_per_node(node.config)}",
        f"--master-addr={where[0]}",
        f"--master-port={where[1]}",
        f"--rdzv-id={run_id}",
        *torchrun.args,
        config.trainer.entry,
        *config.trainer.args,
        *extra,
    ]


def nproc_per_node(config: Config) -> int | str:
    """torchrun.nproc_per_node, or one process per GPU of run.gpus where it says `gpu`
    or `auto` (what torchrun would count from CUDA_VISIBLE_DEVICES, said outright)."""
    nproc = config.torchrun.nproc_per_node
    if config.run.gpus is not None and nproc in ("gpu", "auto"):
        return len(config.run.gpus)
    return nproc


# For tests only: how long the first node keeps the commit store up for the others to
# read its decision (the barrier's ACK_WAIT_S, 15 s, where unset). A test whose node
# never arrives waits all of it out at each deploy.
ACK_WAIT_ENV = "DFLASH_TEST_COMMIT_ACK_WAIT_S"


@cache
def barrier_program() -> str:
    """The commit barrier's program, run by each node's agent in the run's interpreter."""
    folder = resources.files("dflashctl.agent")
    return folder.joinpath("commit_barrier.py").read_text(encoding="utf-8")


def commit_deadline(config: Config, upload_bytes: int) -> float:
    """How long the nodes wait for each other at the barrier: run.commit_timeout_s, plus
    room for the largest upload (the slowest node's, at 1 MB/s as the upload's own
    timeout reckons); half of it with nothing to build, when every node is about as far
    along. A node may make its venv before it arrives: the setup's timeout on top."""
    setup = setup_env.setup_params(config)
    base = config.run.commit_timeout_s
    wait = base / 2 if not upload_bytes else base + upload_bytes / 1e6
    return wait + (float(setup["timeout_s"]) if setup else 0.0)


def every_launch_params(
    config: Config,
    nodes: list[Node],
    run_id: str,
    releases: list[str | None],
    meta: dict[str, Any],
    *,
    extra_args: list[str],
    fresh: bool,
    by: str,
    wait: bool,
    upload_bytes: int = 0,
) -> tuple[Rendezvous | None, dict[int, LaunchParams]]:
    """Where the nodes meet (rendezvous_for) and what each node's agent launches: the
    parameters of its `launch` (or `deploy`) verb, by node index (`releases`: each
    node's, None for its current one: a restart). On one node, the plain run; on
    several, each node's torchrun, its place in the job, and the commit it waits at."""
    rendezvous = rendezvous_for(config, nodes)
    deadline_s = commit_deadline(config, upload_bytes)

    def one(node: Node) -> LaunchParams:
        release = releases[node.index]
        where = (rendezvous.address, rendezvous.port) if rendezvous else None
        command = node_command(config, node, len(nodes), where, run_id, extra_args)
        node_meta = (
            None
            if rendezvous is None
            else {
                "name": node.name,
                "rank": node.index,
                "count": len(nodes),
                "names": [n.name for n in nodes],
                "rendezvous": rendezvous.endpoint,
            }
        )
        params = launch_params(
            node.config,
            run_id,
            release,
            command,
            dict(meta, node=node_meta) if node_meta else meta,
            # Only the first node continues a checkpoint: rank 0 is there, and the trainer
            # gives every rank what rank 0 resumes from.
            fresh=fresh or node.index > 0,
            by=by,
            wait=wait,
        )
        if rendezvous is None:
            return params
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
        params["commit"] = {
            "world": len(nodes),
            "rank": node.index,
            "names": [n.name for n in nodes],
            "address": rendezvous.address,
            "port": rendezvous.commit_port,
            "job_port": rendezvous.port,
            "run_id": run_id,
            "deadline_s": deadline_s,
            "program": barrier_program(),
            "secret": barrier_secret(run_id),
        }
        if release is None:  # a restart: the barrier also checks every node's current release
            params["commit"]["same_release"] = True
        if os.environ.get(ACK_WAIT_ENV):
            params["commit"]["ack_wait_s"] = float(os.environ[ACK_WAIT_ENV])
        return params

    return rendezvous, {node.index: one(node) for node in nodes}


# The commit store (a torch TCPStore) has no authentication: whoever reaches its port
# could arrive or decide for the nodes. Every key of a deploy is under a secret that
# only its nodes get, over SSH on the agent's stdin, so a peer that guessed the run id
# still cannot name a key. One secret per run id, the same on every node of a deploy
# (a key of this process's own, never sent, makes it).
_BARRIER_KEY = secrets.token_bytes(32)


def barrier_secret(run_id: str) -> str:
    return hmac.new(_BARRIER_KEY, run_id.encode("utf-8"), hashlib.sha256).hexdigest()[:32]
