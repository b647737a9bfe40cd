"""Where to connect, after applying ~/.ssh/config like `ssh` would.

paramiko parses ssh_config but its connect() ignores it, so the alias is resolved here:
HostName, User, Port, IdentityFile, ProxyJump and ProxyCommand. Values set in
dflash.yaml win; a port or user left null there is taken from ssh_config, then from
the defaults (22, root). When ssh_config gives both ProxyJump and ProxyCommand for a
host, ProxyJump is used (OpenSSH takes whichever comes first in the file, an order
paramiko's lookup does not keep); host.proxy_jump in dflash.yaml overrides both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dflashctl.errors import ConfigError

if TYPE_CHECKING:
    from dflashctl.config.schema import HostConfig

SSH_CONFIG_ENV = "DFLASHCTL_SSH_CONFIG"  # lets tests point at their own file
DEFAULT_PORT = 22
# pct and pvesh need root on the node, so root (not the local user, as ssh would) is
# the default when neither dflash.yaml nor ssh_config names a user.
DEFAULT_USER = "root"


@dataclass
class SSHDestination:
    alias: str  # what the user wrote (host.address or a ProxyJump entry)
    hostname: str  # what we actually connect to
    port: int
    user: str
    identity_files: list[str] = field(default_factory=list)
    proxy_jump: str | None = None
    proxy_command: str | None = None  # with %h, %p, %r already expanded by paramiko

    @property
    def known_hosts_name(self) -> str:
        """The name OpenSSH and paramiko look up in known_hosts."""
        return self.hostname if self.port == DEFAULT_PORT else f"[{self.hostname}]:{self.port}"

    def __str__(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def ssh_config_path() -> Path:
    return Path(os.environ.get(SSH_CONFIG_ENV) or "~/.ssh/config").expanduser()


def _lookup(alias: str) -> dict:
    path = ssh_config_path()
    if not path.is_file():
        return {}
    import paramiko

    try:
        return dict(paramiko.SSHConfig.from_path(str(path)).lookup(alias))
    except (OSError, ValueError, paramiko.SSHException) as exc:
        raise ConfigError(f"{path}: cannot use this ssh config: {exc}") from exc


def split_user_host_port(spec: str) -> tuple[str | None, str, int | None]:
    """`user@host:port` (user and port optional) as OpenSSH's ProxyJump accepts it."""
    user, _, rest = spec.rpartition("@")
    host, port = rest, None
    if rest.startswith("["):  # [v6addr]:port
        host, _, tail = rest[1:].partition("]")
        if tail.startswith(":"):
            port = int(tail[1:])
    elif rest.count(":") == 1:
        host, port_text = rest.split(":")
        port = int(port_text)
    return user or None, host, port


def resolve(
    address: str,
    *,
    port: int | None = None,
    user: str | None = None,
    identity_file: str | None = None,
    proxy_jump: str | None = None,
) -> SSHDestination:
    """Apply ssh_config for `address`; explicit arguments win over it."""
    found = _lookup(address)
    identity_files = [identity_file] if identity_file else []
    identity_files += [str(Path(p).expanduser()) for p in found.get("identityfile", [])]
    jump = proxy_jump or found.get("proxyjump")
    if jump and jump.lower() == "none":
        jump = None
    command = None if jump or proxy_jump else found.get("proxycommand")
    if command and command.strip().lower() == "none":
        command = None
    try:
        config_port = int(found["port"]) if "port" in found else None
    except ValueError as exc:
        raise ConfigError(
            f"{ssh_config_path()}: Port for {address} is not a number: {found['port']!r}"
        ) from exc
    return SSHDestination(
        alias=address,
        hostname=found.get("hostname", address),
        port=port or config_port or DEFAULT_PORT,
        user=user or found.get("user") or DEFAULT_USER,
        identity_files=list(dict.fromkeys(identity_files)),
        proxy_jump=jump,
        proxy_command=command,
    )


def resolve_jumps(spec: str) -> list[SSHDestination]:
    """ProxyJump's comma-separated hops, each itself resolved through ssh_config."""
    hops = []
    for part in spec.split(","):
        user, host, port = split_user_host_port(part.strip())
        hop = resolve(host, port=port, user=user)
        # Nested jumps or commands are not followed: list every hop in one ProxyJump.
        hop.proxy_jump = hop.proxy_command = None
        hops.append(hop)
    return hops


def resolve_host(host: HostConfig) -> SSHDestination:
    """dflash.yaml's `host:` section (a HostConfig) resolved as ssh would."""
    return resolve(
        host.address,
        port=host.port,
        user=host.user,
        identity_file=host.identity_file,
        proxy_jump=host.proxy_jump,
    )
