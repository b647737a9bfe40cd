"""Ranks of one host split over several containers: each container sees only its own
GPUs, so the ranks lose NVLink peer access and CUDA IPC between them and NCCL falls back
to shared memory or sockets. The fix keeps a host's ranks in one container: the first
container of the host (in the config's order) gets every GPU the others have, as devN
entries; the user then makes the config one node there with nproc_per_node covering
them. No container is deleted or changed but the first.
"""

from __future__ import annotations

import re
from typing import Any

from dflashctl.container import create, ctconfig, host
from dflashctl.container.repair import Finding, missing_container


def split_groups(nodes: list[Any]) -> list[list[Any]]:
    """Nodes (nodes.Node) of one host with more than one container, in config order.
    Nodes on one host share its transport (nodes.node_sessions)."""
    by_host: dict[int, list[Any]] = {}
    for node in nodes:
        if node.config.container.vmid is not None:
            by_host.setdefault(id(node.target.transport), []).append(node)
    return [
        group
        for group in by_host.values()
        if len({node.config.container.vmid for node in group}) > 1
    ]


def gpus_in(config: ctconfig.CtConfig) -> set[int]:
    found = (re.fullmatch(r"/dev/nvidia(\d+)", p) for p in config.devices().values())
    return {int(m.group(1)) for m in found if m}


def finding(group: list[Any]) -> Finding:
    first = group[0]
    target, vmid = first.target, first.config.container.vmid
    gpus_by_vmid: dict[int, set[int]] = {}
    first_config = None
    for node in group:
        ct = node.config.container
        found = create.read_config(target, ct.vmid)
        chosen = set(ct.gpus) if isinstance(ct.gpus, list) else set()
        gpus_by_vmid[ct.vmid] = (gpus_in(found) if found else set()) | chosen
        if node is first:
            first_config = found
    if first_config is None:
        raise missing_container(vmid, target)
    every = sorted(set().union(*gpus_by_vmid.values()))
    held = ", ".join(
        f"{v} (GPU {', '.join(map(str, sorted(g))) or 'none'})" for v, g in gpus_by_vmid.items()
    )
    others = ", ".join(str(v) for v in gpus_by_vmid if v != vmid)
    advice = (
        f"then make the config one node on {target.transport.description}: container "
        f"{vmid} with container.gpus: {every} and torchrun.nproc_per_node: {len(every)}, "
        f"and drop the nodes of container {others} (left on the host as they are)"
    )
    missing = ctconfig.missing_devices(
        first_config, ctconfig.wanted_devices(host.probe(target.transport), every)
    )
    problem = (
        f"ranks of one host split over several containers: {held} on "
        f"{target.transport.description} lose NVLink and CUDA IPC between them"
    )
    if not missing:
        return Finding("ranks split", problem, f"container {vmid} has them all; {advice}", None)
    argv = create.set_argv(vmid, missing)
    return Finding(
        "ranks split",
        problem,
        f"give container {vmid} every GPU ({' '.join(argv)}); {advice}",
        lambda: create.run_pct(target, argv),
        restarts=True,
    )
