"""Transports: how dflashctl runs commands and moves files on the host.

`open_transport(config.host)` gives a LocalTransport for `address: local`, else a
RemoteTransport: commands over paramiko's SSHTransport, a deploy's archive through the
system's OpenSSH when it can (remote.py). paramiko is imported only when a command
needs it, so the CLI starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflashctl.remote.transport.base import (
    CommandFailed,
    CommandResult,
    CommandTimeout,
    ConnectFailed,
    ConnectionLost,
    Stream,
    Transport,
)
from dflashctl.remote.transport.local import LocalTransport

if TYPE_CHECKING:
    from dflashctl.config.schema import HostConfig

__all__ = [
    "CommandFailed",
    "CommandResult",
    "CommandTimeout",
    "ConnectFailed",
    "ConnectionLost",
    "LocalTransport",
    "Stream",
    "Transport",
    "open_transport",
]


def open_transport(host: HostConfig) -> Transport:
    """The transport for host.address; an SSH one connects lazily, on first use."""
    if host.is_local:
        return LocalTransport()
    from dflashctl.remote.transport.remote import RemoteTransport

    return RemoteTransport(host)
