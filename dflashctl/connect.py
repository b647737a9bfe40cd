"""From a Config to what a command talks to: the transport, the Proxmox API, the target.

    with connect(config) as (transport, proxmox, target):
        ...

One SSH connection serves everything (exec, SFTP, pvesh). `proxmox` is None when no
container is configured (container.vmid: null): then there is no Proxmox call at all.
Any low-level failure inside the block (paramiko, sockets, proxmoxer) leaves it as one
plain-sentence HostError (exit code 3); the connection is always closed.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any, NamedTuple

from dflashctl.config import Config
from dflashctl.errors import DflashError, HostError
from dflashctl.target import Target
from dflashctl.transport import Transport, open_transport


class Connection(NamedTuple):
    transport: Transport
    proxmox: Any  # proxmoxer ProxmoxResource, or None without a container
    target: Target


def open_proxmox(config: Config, transport: Transport) -> Any:
    """The Proxmox API for this config (None when there is no container)."""
    if config.container.vmid is None:
        return None
    from dflashctl import proxmox

    if config.proxmox.api == "https":
        return proxmox.https_api(config.proxmox)
    return proxmox.ssh_api(transport)


def _low_level_errors() -> tuple[type[BaseException], ...]:
    kinds: list[type[BaseException]] = [EOFError, ConnectionError, socket.timeout]
    try:  # only when they are already loaded: nothing heavy is imported for this
        import sys

        if "paramiko" in sys.modules:
            kinds.append(sys.modules["paramiko"].SSHException)
        if "proxmoxer.core" in sys.modules:
            kinds.append(sys.modules["proxmoxer.core"].ResourceException)
    except AttributeError:
        pass
    return tuple(kinds)


@contextlib.contextmanager
def connect(config: Config) -> Iterator[Connection]:
    transport = open_transport(config.host)
    try:
        proxmox = open_proxmox(config, transport)
        yield Connection(transport, proxmox, Target(transport, config.container.vmid))
    except DflashError:
        raise
    except _low_level_errors() as exc:
        detail = str(exc).strip() or type(exc).__name__
        raise HostError(
            f"talking to {transport.description} failed: {detail}",
            hint="check the host and the network, then run the command again",
        ) from exc
    finally:
        transport.close()


def ensure_running(connection: Connection, config: Config, *, start: bool = False) -> Any:
    """The container's state, after starting it when allowed (start or
    container.start_if_stopped). Raises ContainerNotRunning otherwise."""
    from dflashctl import proxmox
    from dflashctl.pct import ContainerNotRunning, not_running_hint

    vmid = config.container.vmid
    if vmid is None or connection.proxmox is None:
        return None
    status = proxmox.container_status(connection.proxmox, config.proxmox.node, vmid)
    if status.running:
        return status
    if start or config.container.start_if_stopped:
        return proxmox.start_container(connection.proxmox, config.proxmox.node, vmid)
    raise ContainerNotRunning(f"container {vmid} is {status.status}", hint=not_running_hint(vmid))
