"""What breaks in a GPU container, found and (by `doctor --fix`) repaired.

Each Finding says what is wrong, what its fix does, whether the fix changes the
container (then a `pct snapshot` is taken first where its storage can) and whether it
takes effect only at the container's next start (then the fix says so before doing it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflashctl.container import create, ctconfig, host, inside
from dflashctl.container.ctconfig import CtConfig
from dflashctl.container.host import HostGpus
from dflashctl.errors import HostError
from dflashctl.humanize import human_bytes
from dflashctl.remote.deploy_target import Target

NO_SNAPSHOT = "snapshot feature is not available"


@dataclass
class Finding:
    name: str  # the check's name: "host driver libs", "device majors", ...
    problem: str
    fix: str  # what the fix does, in one line
    apply: Callable[[], None] | None  # None: no automatic fix (the fix line says what to do)
    changes_container: bool = True
    restarts: bool = False


@dataclass
class Survey:
    """Everything the checks look at, read once."""

    host: HostGpus
    config: CtConfig
    inside: inside.Inside | None  # None while the container does not run


def missing_container(vmid: int, target: Target) -> HostError:
    return HostError(
        f"container {vmid} does not exist on {target.transport.description}",
        hint="make it with `dflashctl container create`",
    )


def survey(config: Any, target: Target) -> Survey:
    vmid = config.container.vmid
    found = create.read_config(target, vmid)
    if found is None:
        raise missing_container(vmid, target)
    seen = None
    if create.is_running(target, vmid):
        seen = inside.probe(target, config.container.python)
    return Survey(host.probe(target.transport), found, seen)


def findings(config: Any, target: Target, seen: Survey) -> list[Finding]:
    vmid = config.container.vmid
    found: list[Finding] = []
    hosted = seen.host
    if hosted.driver_version is None:
        return [
            Finding(
                "host driver",
                f"no NVIDIA driver on {target.transport.description}",
                "install the NVIDIA driver on the Proxmox host",
                None,
                False,
            )
        ]
    if hosted.missing_uvm:
        found.append(
            Finding(
                "host uvm nodes",
                f"{', '.join(hosted.missing_uvm)} missing on the host (made only once "
                "something used CUDA there)",
                "make them on the host: nvidia-modprobe -u -c=0 (or mknod with the "
                f"nvidia-uvm major of its /proc/devices, {hosted.uvm_major})",
                lambda: host.make_uvm_nodes(target.transport),
                changes_container=False,
                restarts=seen.inside is not None,
            )
        )
    wanted = ctconfig.wanted_devices(hosted, config.container.gpus)
    stale = seen.config.stale_majors(hosted)
    raw = seen.config.raw_nvidia_lines(hosted)
    if stale:
        found.append(
            Finding(
                "device majors",
                f"raw lxc lines allow major {', '.join(map(str, stale))}, which no driver "
                f"holds now (nvidia-uvm is {hosted.uvm_major} on this kernel)",
                f"replace the {len(raw)} raw NVIDIA lines with devN entries (PVE reads "
                "the majors at each start)",
                lambda: _rewrite_raw(config, target, seen, wanted),
                restarts=True,
            )
        )
    elif not raw:
        missing = ctconfig.missing_devices(seen.config, wanted)
        if missing:
            found.append(
                Finding(
                    "GPU devices",
                    "not passed through: " + ", ".join(v.split(",")[0] for _, v in missing),
                    "add them as devN entries: pct set "
                    + " ".join(f"--{k} {v}" for k, v in missing),
                    lambda: create.run_pct(target, create.set_argv(vmid, missing)),
                    restarts=True,
                )
            )
    if seen.inside is not None:
        version = hosted.driver_version
        if not seen.inside.libraries_match(version):
            found.append(
                Finding(
                    "driver libraries",
                    seen.inside.library_problem(version),
                    f"install the NVIDIA {version} user-space libraries in the container "
                    "(--no-kernel-module)",
                    lambda: create.install_libraries(config, target, version),
                )
            )
        need = create.wanted_shm(config, hosted)
        have = seen.inside.shm_bytes
        if have is not None and have < need:
            ranks = create.ranks_of(config, hosted)
            found.append(
                Finding(
                    "/dev/shm",
                    f"/dev/shm is {human_bytes(have)}, {ranks} rank(s) need "
                    f"{human_bytes(need)} (NCCL: "
                    "posix_fallocate ... No space left; DataLoader workers: bus error)",
                    f"mount a {ctconfig.human_size(need)} tmpfs on /dev/shm",
                    create.shm_action(target, vmid, need).apply,
                    restarts=True,
                )
            )
    return found


def _rewrite_raw(config: Any, target: Target, seen: Survey, wanted: list[str]) -> None:
    vmid = config.container.vmid
    old = host.read_conf(target.transport, vmid)
    drop = set(seen.config.raw_nvidia_lines(seen.host))
    host.write_conf(
        target.transport,
        vmid,
        old,
        host.edit_raw_lines(old, lambda k, v: (k, v) in drop, []),
    )
    missing = ctconfig.missing_devices(seen.config, wanted)
    if missing:
        create.run_pct(target, create.set_argv(vmid, missing))


def snapshot(target: Target, vmid: int, number: int) -> str | None:
    """A `pct snapshot` before fix `number`: its name, or None where the storage cannot
    take one."""
    name = time.strftime(f"dflashctl-fix-%Y%m%d-%H%M%S-{number}")
    result = target.transport.run(create.pct_argv("snapshot", vmid, name), check=False)
    if result.exit_status == 0:
        return name
    if NO_SNAPSHOT in result.stderr_text:
        return None
    raise HostError(
        f"`pct snapshot {vmid} {name}` failed: {result.last_error_line()}",
        hint="nothing was changed; see pct's message",
    )
