"""From a Config to what a command talks to: the target, and the Proxmox API.

    with session(config) as target:          # most commands
        ...
    with connect(config) as (transport, proxmox, target):   # commands that need the API
        ...

One SSH connection serves everything (exec, SFTP, pvesh). `proxmox` is None when no
container is configured (container.vmid: null): then there is no Proxmox call at all.
Any low-level failure inside the block (paramiko, sockets) leaves it as one
plain-sentence HostError (exit code 3); the connection is always closed.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

from dflashctl.config.schema import Config
from dflashctl.errors import DflashError, HostError
from dflashctl.remote.deploy_target import Target
from dflashctl.remote.transport import Transport, open_transport


def open_target(config: Config) -> Target:
    """The target for this config; an SSH connection opens on first use. The caller
    closes it (target.close()), or uses session() which does."""
    return Target(open_transport(config.host), config.container.vmid)


@contextlib.contextmanager
def session(config: Config) -> Iterator[Target]:
    """The target for one command, closed at the end; a low-level failure (a socket,
    paramiko) becomes one plain HostError (exit 3)."""
    target = open_target(config)
    try:
        with as_host_error(target):
            yield target
    finally:
        target.close()


@contextlib.contextmanager
def as_host_error(target: Target) -> Iterator[None]:
    """A low-level failure inside the block (a socket, paramiko) as one plain HostError."""
    try:
        yield
    except DflashError:
        raise
    except _low_level_errors() as exc:
        detail = str(exc).strip() or type(exc).__name__
        raise HostError(
            f"talking to {target.transport.description} failed: {detail}",
            hint="check the host and the network, then run the command again",
        ) from exc


def _low_level_errors() -> tuple[type[BaseException], ...]:
    # remote/proxmox.py already turns every API failure into a HostError; what is left is the
    # connection itself.
    kinds: list[type[BaseException]] = [EOFError, ConnectionError, socket.timeout]
    paramiko = sys.modules.get("paramiko")  # never imported just for this
    if paramiko is not None:
        kinds.append(paramiko.SSHException)
    return tuple(kinds)


class Connection(NamedTuple):
    transport: Transport
    proxmox: Any  # proxmoxer ProxmoxResource, or None without a container
    target: Target


def open_proxmox(config: Config, transport: Transport) -> Any:
    """The Proxmox API for this config (None when there is no container)."""
    if config.container.vmid is None:
        return None
    from dflashctl.remote import proxmox

    if config.proxmox.api == "https":
        return proxmox.https_api(config.proxmox)
    return proxmox.ssh_api(transport)


@contextlib.contextmanager
def connect(config: Config) -> Iterator[Connection]:
    """session() plus the Proxmox API, over the same connection."""
    with session(config) as target:
        yield Connection(target.transport, open_proxmox(config, target.transport), target)
