"""What `status` says of every node: its container, the release `current` names and
the active run, every node asked at once; data only (commands/status.py shows it)."""

from __future__ import annotations

from typing import Any

from dflashctl.errors import HostError
from dflashctl.remote.nodes import Node, NodeOutcome, node_sessions, on_every_node


def status_of_every_node(config: Any) -> list[NodeOutcome[dict[str, Any]]]:
    """Each node's status (node_status), or the error that kept it from one."""
    from dflashctl.remote.connect import open_proxmox

    def one(node: Node) -> dict[str, Any]:
        api = open_proxmox(node.config, node.target.transport)
        return node_status(node.config, api, node.target)

    with node_sessions(config) as nodes:
        return on_every_node(nodes, one)


def node_status(config: Any, api: Any, target: Any) -> dict[str, Any]:
    """The container's state, the release `current` names and the active run of the
    one target `config` names (`api`: its Proxmox API, None without a container)."""
    from dflashctl.remote import proxmox
    from dflashctl.remote.transport import ConnectionLost
    from dflashctl.runs import records as runs

    container = None
    if api is not None:
        container = proxmox.container_status(api, config.proxmox.node, target.vmid)
    run, release, run_error = None, None, None
    # A stopped container has no running process to ask about; its files stay, but
    # reading them needs the container up (pct exec).
    if container is None or container.running:
        try:
            run, release = runs.active_run_and_release(
                target, config.container.workdir, python=config.container.python
            )
        except ConnectionLost:
            raise
        except HostError as exc:  # still worth showing the container's state
            run_error = {"message": exc.message, "hint": exc.hint}
    holders = []
    if container is not None and container.running:
        from dflashctl.container.holders import live_holders

        holders = [h.to_json() for h in live_holders(target)]
    return {
        "target": target.describe(),
        "node": config.proxmox.node if api is not None else None,
        "container": container.to_json() if container else None,
        "workdir": config.container.workdir,
        "release": release,
        "active_run": run.to_json() if run else None,
        "active_run_error": run_error,
        "gpu_holders": holders,  # every live run of the container and its GPUs
    }
