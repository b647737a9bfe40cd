"""`pct` on the Proxmox node: argv builders and the parsing of its answers and errors.

The Proxmox API cannot run commands in a container or copy files into one, so these
travel over SSH as `pct exec` (files on its stdin). The error texts matched here are pct's own
(pve-container src/PVE/CLI/pct.pm, src/PVE/AbstractConfig.pm) and lxc-attach's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from dflashctl.errors import HostError
from dflashctl.remote.transport.base import CommandResult

_MISSING_CONFIG = re.compile(r"Configuration file 'nodes/([^/']+)/lxc/(\d+)\.conf' does not exist")
_NOT_RUNNING = re.compile(
    r"^(?:Error: )?container '\d+' not running!"  # pct exec's own check (pct.pm ~244)
    r"|^lxc-attach: .*Failed to get init pid"  # lxc-attach, when the container stops meanwhile
    r"|^CT \d+ not running",  # pct's own check (pct stop, some pct exec releases)
    re.MULTILINE,
)
# A shell's answer for a missing pct: sh ("sh: 1: pct: not found"), bash ("bash: pct:
# command not found"), `exec pct` ("exec: pct: not found"), our local transport.
_PCT_MISSING = re.compile(r"(?:^|[\s:])pct: (?:command )?not found", re.MULTILINE)
NOT_PROXMOX_HINT = (
    "point host.address at the Proxmox node, or set container.vmid: null "
    "to run directly on this host"
)


class NotProxmoxNode(HostError):
    """The host lacks Proxmox's tools (pct, pvesh): said alike by every command."""


def not_a_proxmox_node(tool: str, where: str) -> NotProxmoxNode:
    """`where`: the host's transport description ("local": this machine)."""
    where = "this machine" if where == "local" else where
    return NotProxmoxNode(
        f"{tool} is not installed on {where}: it does not look like a Proxmox VE node",
        hint=NOT_PROXMOX_HINT,
    )


def pct_missing(result: CommandResult) -> bool:
    return result.exit_status in (127, 199) and bool(_PCT_MISSING.search(result.stderr_text))


class ContainerNotFound(HostError):
    """No container with this vmid on the node."""


class ContainerNotRunning(HostError):
    """The container exists but is stopped."""


# A root login's PATH in a Debian container (/etc/profile). `pct exec` keeps the SSH
# session's environment and forces PATH=/sbin:/bin:/usr/sbin:/usr/bin (pve-common
# CLIHandler.pm), which misses /usr/local/bin, where pip puts python3, torchrun, ninja.
LOGIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Start from a root login's environment, not the SSH session's: then read the login
# files as a login shell would (/etc/profile, ~/.profile: CUDA, conda, proxies), with
# their chatter kept out of the command's output, and run the command.
_LOGIN = (
    "[ -r /etc/profile ] && . /etc/profile >/dev/null 2>&1 </dev/null; "
    '[ -r "$HOME/.profile" ] && . "$HOME/.profile" >/dev/null 2>&1 </dev/null; '
    'exec "$@"'
)


def login_argv(argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """argv as it runs in the container: a root login's environment, then `env` on top
    (set after the login files, so that trainer.env wins over them)."""
    login = [
        f"PATH={LOGIN_PATH}",
        "HOME=/root",
        "USER=root",
        "LOGNAME=root",
        "SHELL=/bin/sh",
        "LANG=C.UTF-8",
    ]
    extra = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
    return ["env", "-i", *login, "/bin/sh", "-c", _LOGIN, "sh", *extra, *argv]


def exec_argv(vmid: int, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """`pct exec` of argv with a root login's environment (plus env), not the session's."""
    return ["pct", "exec", str(vmid), "--", *login_argv(argv, env)]


def not_running_hint(vmid: int) -> str:
    """The one hint for a stopped container, wherever it is found stopped; only deploy
    can start it (--start-container)."""
    return f"start it with `pct start {vmid}` on the host, or deploy with --start-container"


def container_error(result: CommandResult, vmid: int, where: str = "the host") -> HostError | None:
    """The container-level error in a failed `pct exec`, or None when pct itself was fine
    (a non-zero status then belongs to the command that ran)."""
    if result.exit_status == 0:
        return None
    if pct_missing(result):
        return not_a_proxmox_node("pct", where)
    stderr = result.stderr_text
    missing = _MISSING_CONFIG.search(stderr)
    if missing:
        node = missing.group(1)
        return ContainerNotFound(
            f"container {vmid} does not exist on node {node}",
            hint="check container.vmid in dflash.yaml; `pct list` on the host lists the "
            "containers (or set container.vmid: null to run on the host itself)",
        )
    if _NOT_RUNNING.search(stderr):
        return ContainerNotRunning(f"container {vmid} is not running", hint=not_running_hint(vmid))
    return None


def raise_for_pct(result: CommandResult, vmid: int, where: str = "the host") -> CommandResult:
    """Raise the clear error for a failed `pct exec`; return the result when it succeeded.
    `where`: the host, for messages."""
    error = container_error(result, vmid, where)
    if error is not None:
        raise error
    return result
