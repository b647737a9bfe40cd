"""`dflashctl container create`: the container a run needs, from the config, as a plan
of actions that a dry run shows and a real run applies in order.

The plan is made in two parts: the node side (host nodes, `pct create` or `pct set`,
/dev/shm, the start), then, once the container runs, the inside (the NVIDIA user-space
libraries of the host driver's version, torch). Each part compares what is there with
what the config asks, so a second run finds everything matching and changes nothing.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashctl.container import ctconfig, host, inside, oci
from dflashctl.container.ctconfig import CtConfig
from dflashctl.container.host import HostGpus
from dflashctl.errors import ConfigError, HostError
from dflashctl.remote.deploy_target import Target

DEFAULT_DISK_GIB = 32  # pct's own default (4 GiB) does not hold torch and a checkpoint
INSTALL_TIMEOUT_S = 1800.0


@dataclass
class Action:
    what: str  # one line for the user: "add dev0 /dev/nvidia0"
    commands: list[str]  # the commands it runs (shown by --dry-run)
    apply: Callable[[], None]
    restarts: bool = False  # takes effect at the container's next start


@dataclass
class Plan:
    matches: list[str] = field(default_factory=list)  # what already is as the config asks
    actions: list[Action] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what it leaves to the user, and why


def pct_argv(*args: Any) -> list[str]:
    return ["pct", *(str(a) for a in args)]


def run_pct(target: Target, argv: list[str], timeout: float = 600.0) -> str:
    result = target.transport.run(argv, timeout=timeout, check=False)
    if result.exit_status != 0:
        text = (result.stderr_text or result.stdout_text).strip()
        raise HostError(
            f"`{shlex.join(argv)}` failed (exit {result.exit_status}): {text}",
            hint="see pct's message above; nothing after this step was done",
        )
    return result.stdout_text


def set_argv(vmid: int, entries: Any) -> list[str]:
    argv = pct_argv("set", vmid)
    for key, value in entries:
        argv += [f"--{key}", value]
    return argv


def pct_action(
    target: Target, what: str, *argvs: list[str], timeout: float = 600.0, restarts: bool = False
) -> Action:
    """An Action running these pct commands in order."""

    def apply() -> None:
        for argv in argvs:
            run_pct(target, argv, timeout)

    return Action(what, [shlex.join(argv) for argv in argvs], apply, restarts)


def read_config(target: Target, vmid: int) -> CtConfig | None:
    """The container's config, or None when the node has no container `vmid`."""
    result = target.transport.run(pct_argv("config", vmid), check=False)
    if result.exit_status != 0:
        if "does not exist" in result.stderr_text:
            return None
        raise HostError(
            f"`pct config {vmid}` failed: {result.last_error_line()}",
            hint="run it on the node to see why",
        )
    return ctconfig.parse(result.stdout_text)


def is_running(target: Target, vmid: int) -> bool:
    return "status: running" in run_pct(target, pct_argv("status", vmid))


def ranks_of(config: Any, host_gpus: HostGpus) -> int:
    """How many ranks this node's container runs (for /dev/shm): torchrun's
    nproc_per_node when a number, else one per GPU passed through."""
    nproc = getattr(getattr(config, "torchrun", None), "nproc_per_node", None)
    if isinstance(nproc, int):
        return nproc
    gpus = config.container.gpus
    return len(gpus) if isinstance(gpus, list) else max(1, len(host_gpus.gpu_indices))


def wanted_shm(config: Any, host_gpus: HostGpus) -> int:
    size = config.container.shm_size
    if size is not None:
        return ctconfig.size_bytes(size)
    return ctconfig.shm_need(ranks_of(config, host_gpus))


def host_actions(target: Target, host_gpus: HostGpus) -> list[Action]:
    if not host_gpus.missing_uvm:
        return []
    return [
        Action(
            f"make {', '.join(host_gpus.missing_uvm)} on the host (they appear only once "
            "something used CUDA there)",
            ["nvidia-modprobe -u -c=0  (or mknod c <nvidia-uvm major from /proc/devices> 0/1)"],
            lambda: host.make_uvm_nodes(target.transport),
        )
    ]


def shm_action(target: Target, vmid: int, size: int) -> Action:
    key, value = ctconfig.shm_entry(size)

    def apply() -> None:
        old = host.read_conf(target.transport, vmid)
        new = host.edit_raw_lines(
            old, lambda k, v: (k, v) == ctconfig.shm_line([(k, v)]), [(key, value)]
        )
        host.write_conf(target.transport, vmid, old, new)

    return Action(
        f"/dev/shm of {ctconfig.human_size(size)}",
        [f"set in /etc/pve/lxc/{vmid}.conf: {key}: {value}"],
        apply,
        restarts=True,
    )


def _create_argv(config: Any, vmid: int, ostemplate: str, devices: list[str]) -> list[str]:
    ct = config.container
    argv = pct_argv("create", vmid, ostemplate)
    argv += ["--hostname", ct.hostname or f"dflash-{vmid}"]
    if ct.cores:
        argv += ["--cores", str(ct.cores)]
    if ct.memory:
        argv += ["--memory", str(ct.memory)]
    argv += ["--rootfs", f"{ct.storage}:{ct.disk or DEFAULT_DISK_GIB}"]
    argv += ["--unprivileged", "1" if ct.unprivileged else "0"]
    argv += ["--features", "nesting=1", "--net0", ct.net0]
    for index, path in enumerate(devices):
        argv += [f"--dev{index}", ctconfig.device_value(path)]
    return argv


def node_plan(config: Any, target: Target, host_gpus: HostGpus) -> tuple[Plan, bool]:
    """The node side of the plan; and whether the container exists already."""
    vmid = config.container.vmid
    ct = config.container
    plan = Plan()
    if host_gpus.driver_version is None or not host_gpus.gpu_indices:
        raise HostError(
            f"no NVIDIA GPU driver on {target.transport.description}: no "
            "/proc/driver/nvidia/version or no /dev/nvidia[0-9]*",
            hint="install the NVIDIA driver on the Proxmox host first (and reboot)",
        )
    wanted = ctconfig.wanted_devices(host_gpus, ct.gpus)
    plan.actions += host_actions(target, host_gpus)
    shm = wanted_shm(config, host_gpus)
    current = read_config(target, vmid)
    if current is None:
        if not ct.template:
            raise ConfigError(
                f"container {vmid} does not exist and container.template is not set",
                hint="set container.template to a CT template on the node, e.g. "
                "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst (pveam available; "
                "pveam download local <name>), or an OCI image on PVE 9.1+",
            )
        volume, pull = oci.ostemplate(config, target)
        if pull is not None:
            plan.actions.append(
                Action(
                    f"pull the OCI image {ct.template} into {volume}",
                    [shlex.join(pull)],
                    lambda: oci.pull(target, pull),
                )
            )
        plan.actions += [
            pct_action(
                target,
                f"create container {vmid} from {ct.template} with {len(wanted)} devices",
                _create_argv(config, vmid, volume, wanted),
                timeout=INSTALL_TIMEOUT_S,
            ),
            shm_action(target, vmid, shm),
            pct_action(target, f"start container {vmid}", pct_argv("start", vmid)),
        ]
        return plan, False
    _compare_options(plan, target, config, current)
    missing = ctconfig.missing_devices(current, wanted)
    if current.raw_nvidia_lines(host_gpus):
        # Passed by hand already: devN entries on top would bind each node twice.
        plan.notes.append(
            "raw lxc lines pass the NVIDIA devices by hand: `dflashctl doctor --fix` "
            "rewrites them as devN entries (left as they are here)"
        )
    elif missing:
        plan.actions.append(
            pct_action(
                target,
                "pass through " + ", ".join(value.split(",")[0] for _, value in missing),
                set_argv(vmid, missing),
                restarts=True,
            )
        )
    else:
        plan.matches.append(f"devices: {', '.join(wanted)}")
    have_shm = current.shm_bytes()
    if have_shm == shm:
        plan.matches.append(f"/dev/shm: {ctconfig.human_size(shm)}")
    else:
        plan.actions.append(shm_action(target, vmid, shm))
    if bool(current.options.get("unprivileged") == "1") != ct.unprivileged:
        plan.notes.append(
            f"container.unprivileged is {str(ct.unprivileged).lower()} but container {vmid} "
            "is not: PVE cannot change that on an existing container (left as it is)"
        )
    running = is_running(target, vmid)
    start = pct_argv("start", vmid)
    if running and any(a.restarts for a in plan.actions):
        plan.actions.append(
            pct_action(
                target,
                f"restart container {vmid} (new devices and /dev/shm apply at its start)",
                pct_argv("stop", vmid),
                start,
            )
        )
    elif not running:
        plan.actions.append(pct_action(target, f"start container {vmid}", start))
    else:
        plan.matches.append(f"container {vmid} runs")
    return plan, True


def _compare_options(plan: Plan, target: Target, config: Any, current: CtConfig) -> None:
    ct = config.container
    wanted = {"cores": ct.cores, "memory": ct.memory, "hostname": ct.hostname}
    changes = {
        key: str(value)
        for key, value in wanted.items()
        if value is not None and current.options.get(key) != str(value)
    }
    same = [
        f"{key} {value}"
        for key, value in wanted.items()
        if value is not None and key not in changes
    ]
    if same:
        plan.matches.append(", ".join(same))
    if changes:
        plan.actions.append(
            pct_action(
                target,
                ", ".join(f"{k} {current.options.get(k, '-')} -> {v}" for k, v in changes.items()),
                set_argv(ct.vmid, changes.items()),
            )
        )
    if ct.disk is not None:
        _compare_disk(plan, target, ct, current)


def _compare_disk(plan: Plan, target: Target, ct: Any, current: CtConfig) -> None:
    """Grow the root disk to container.disk (pct resize; online, no restart). Never
    shrink: PVE cannot (resize_vm: "unable to shrink disk size")."""
    size_text = current.options.get("rootfs", "").rpartition("size=")[2].split(",")[0]
    try:
        have = ctconfig.size_bytes(size_text)
    except ValueError:
        plan.notes.append(f"the root disk's size is unknown (rootfs: {size_text!r}): not resized")
        return
    want = ct.disk * ctconfig.GIB
    shown = ctconfig.human_size(have)
    if have == want:
        plan.matches.append(f"root disk {shown}")
    elif have > want:
        plan.notes.append(
            f"container.disk asks {ct.disk}G but the root disk of container {ct.vmid} is "
            f"{shown}: Proxmox cannot shrink a container's disk, so it stays {shown} "
            f"(set container.disk to {-(-have // ctconfig.GIB)} or more to silence this)"
        )
    else:
        plan.actions.append(
            pct_action(
                target,
                f"grow the root disk {shown} -> {ct.disk}G",
                pct_argv("resize", ct.vmid, "rootfs", f"{ct.disk}G"),
                timeout=INSTALL_TIMEOUT_S,
            )
        )


def installer_source(config: Any, version: str) -> tuple[str, bool]:
    """(the installer for `version`, whether it is a file on this machine)."""
    text = config.container.nvidia_installer.format(version=version)
    if "://" in text:
        return text, False
    path = Path(text).expanduser()
    if not path.is_absolute() and getattr(config, "path", None) is not None:
        path = Path(config.path).parent / path
    if not path.is_file():
        raise ConfigError(
            f"container.nvidia_installer: {path} does not exist",
            hint=f"download NVIDIA-Linux-x86_64-{version}.run there, or give its URL",
        )
    return str(path), True


def install_libraries(config: Any, target: Target, version: str) -> None:
    source, local = installer_source(config, version)
    if local:
        target.run(
            ["sh", "-c", 'cat > "$0"', "/tmp/dflashctl-nvidia-installer.run"],
            stdin=Path(source).read_bytes(),
            timeout=INSTALL_TIMEOUT_S,
        )
    result = target.run(
        ["sh", "-c", inside.install_script(source, local)],
        timeout=INSTALL_TIMEOUT_S,
        check=False,
    )
    if result.exit_status != 0:
        raise HostError(
            f"the NVIDIA {version} installer failed in {target.describe()}: "
            f"{result.last_error_line() or f'exit {result.exit_status}'}",
            hint="its log is /var/log/nvidia-installer.log in the container",
        )


def libraries_action(config: Any, target: Target, version: str, problem: str) -> Action:
    source = config.container.nvidia_installer.format(version=version)
    return Action(
        f"install the NVIDIA {version} user-space libraries ({problem})",
        [f"pct exec {config.container.vmid} -- sh {Path(source).name} --silent --no-kernel-module"],
        lambda: install_libraries(config, target, version),
    )


# container.python naming a venv that is not there yet (/opt/dflash/bin/python): made
# first (Debian's system python refuses pip installs, PEP 668); then pip install torch.
_TORCH_SCRIPT = r"""py="$0"
if [ ! -x "$py" ] && [ "${py%/bin/python*}" != "$py" ]; then
  venv="${py%/bin/python*}"
  python3 -m venv "$venv" 2>/dev/null || {
    apt-get update -qq && apt-get install -y -qq python3-venv && python3 -m venv "$venv"
  } || exit 1
fi
exec "$py" -m pip install torch
"""


def install_torch(config: Any, target: Target) -> None:
    python = config.container.python
    result = target.run(["sh", "-c", _TORCH_SCRIPT, python], timeout=INSTALL_TIMEOUT_S, check=False)
    if result.exit_status != 0:
        raise HostError(
            f"installing torch with {python} in {target.describe()} failed: "
            f"{result.last_error_line() or f'exit {result.exit_status}'}",
            hint="a distribution's python refuses pip (externally-managed-environment): "
            "set container.python to a venv's, e.g. /opt/dflash/bin/python, and run "
            "`dflashctl container create` again (it makes that venv)",
        )


def torch_action(config: Any, target: Target) -> Action:
    python = config.container.python
    return Action(
        "install torch",
        [f"pct exec {config.container.vmid} -- {python} -m pip install torch"],
        lambda: install_torch(config, target),
    )


def inside_plan(config: Any, target: Target, host_gpus: HostGpus) -> Plan:
    """The inside of a running container: its libraries and torch."""
    plan = Plan()
    seen = inside.probe(target, config.container.python)
    version = host_gpus.driver_version or "?"
    if seen.libraries_match(version):
        plan.matches.append(f"NVIDIA user-space libraries {version}, as the host driver")
    else:
        plan.actions.append(
            libraries_action(config, target, version, seen.library_problem(version))
        )
    if seen.torch:
        plan.matches.append(f"torch {seen.torch}")
    else:
        plan.actions.append(torch_action(config, target))
    return plan


def inside_plan_unknown(config: Any, target: Target, host_gpus: HostGpus) -> Plan:
    """For a dry run before the container exists: what will be checked inside it."""
    version = host_gpus.driver_version or "?"
    return Plan(
        actions=[
            libraries_action(config, target, version, "a new container has none"),
            torch_action(config, target),
        ],
        notes=["inside the new container, each is done only where it is missing"],
    )
