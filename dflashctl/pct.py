"""`pct` on the Proxmox node: argv builders and the parsing of its answers and errors.

The Proxmox API cannot run commands in a container or copy files into one, so these
travel over SSH as `pct exec` and `pct push`. The error texts matched here are pct's own
(pve-container src/PVE/CLI/pct.pm, src/PVE/AbstractConfig.pm) and lxc-attach's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dflashctl.errors import HostError
from dflashctl.transport.base import CommandResult, command_text

_MISSING_CONFIG = re.compile(r"Configuration file 'nodes/([^/']+)/lxc/(\d+)\.conf' does not exist")
_NOT_RUNNING = re.compile(
    r"can only push files to a running CT"  # pct push
    r"|can only pull files from a running VM"  # pct pull (sic)
    r"|^lxc-attach: .*Failed to get init pid"  # lxc-attach, under pct exec
    r"|^CT \d+ not running",  # pct's own check (pct stop, some pct exec releases)
    re.MULTILINE,
)
_CREATE_FAILED = re.compile(r"failed to create file: (.+?): (.+)$", re.MULTILINE)


class ContainerNotFound(HostError):
    """No container with this vmid on the node."""


class ContainerNotRunning(HostError):
    """The container exists but is stopped."""


class ContainerPathMissing(HostError):
    """The folder a file is pushed into does not exist."""


def exec_argv(vmid: int, argv: Sequence[str]) -> list[str]:
    return ["pct", "exec", str(vmid), "--", *argv]


def push_argv(vmid: int, src: str, dst: str, perms: int | None = None) -> list[str]:
    argv = ["pct", "push", str(vmid), src, dst]
    if perms is not None:
        argv += ["--perms", format(perms, "o")]  # pct reads it as octal
    return argv


def not_running_hint(vmid: int) -> str:
    """The one hint for a stopped container, wherever it is found stopped."""
    return f"start it with `pct start {vmid}` on the host, or pass --start-container"


def container_error(result: CommandResult, vmid: int, action: str) -> HostError | None:
    """The container-level error in a failed pct call, or None when pct itself was fine
    (for `pct exec`, a non-zero status then belongs to the command that ran)."""
    if result.exit_status == 0:
        return None
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
    if action == "push":
        created = _CREATE_FAILED.search(stderr)
        if created:
            path, reason = created.groups()
            if "No such file" in reason:
                return ContainerPathMissing(
                    f"cannot write {path} in container {vmid}: its folder does not exist",
                    hint="create the folder first (pct push copies one file and makes no folders)",
                )
            return HostError(f"cannot write {path} in container {vmid}: {reason}")
    if action == "exec":
        return None
    return HostError(
        f"`{command_text(result.argv)}` failed with exit status {result.exit_status}: "
        f"{result.last_error_line() or 'no message'}"
    )


def raise_for_pct(result: CommandResult, vmid: int, action: str) -> CommandResult:
    """Raise the clear error for a failed pct call; return the result when it succeeded."""
    error = container_error(result, vmid, action)
    if error is not None:
        raise error
    return result
