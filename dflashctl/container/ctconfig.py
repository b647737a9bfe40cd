"""A container's config as `pct config` prints it, and what a GPU run needs in it.

Devices go in as `devN` entries (pve-container's Config.pm: `path`, `mode`, `uid`, `gid`,
`deny-write`; N below 256): PVE reads each node's major when the container starts, so
they survive a kernel upgrade that moves nvidia-uvm, which hand-written
`lxc.cgroup2.devices.allow` lines do not. /dev/shm is a raw tmpfs mount entry (the API
has no option for it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dflashctl.container.host import UVM_NODES, HostGpus
from dflashctl.errors import ConfigError

MAX_DEVICES = 256
DEVICE_MODE = "0666"
GIB = 1 << 30
_SIZE = re.compile(r"(\d+)([KMGT]?)", re.I)
_ALLOW = re.compile(r"^[ca]\s+(\d+|\*):(\d+|\*)")
SHM_ENTRY = "lxc.mount.entry"


def size_bytes(text: str) -> int:
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a size")
    return (
        int(match.group(1))
        * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": GIB, "T": 1 << 40}[match.group(2).upper()]
    )


def human_size(n: int) -> str:
    for unit, scale in (("T", 1 << 40), ("G", GIB), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


@dataclass
class CtConfig:
    options: dict[str, str] = field(default_factory=dict)
    raw: list[tuple[str, str]] = field(default_factory=list)

    def devices(self) -> dict[str, str]:
        """devN key -> device path."""
        found = {}
        for key, value in self.options.items():
            if re.fullmatch(r"dev\d+", key):
                first = value.split(",")[0]
                found[key] = first.split("=", 1)[1] if first.startswith("path=") else first
        return found

    def free_device_keys(self):
        used = set(self.devices())
        return (f"dev{i}" for i in range(MAX_DEVICES) if f"dev{i}" not in used)

    def shm_bytes(self) -> int | None:
        line = shm_line(self.raw)
        if line is None:
            return None
        for option in line[1].split()[3].split(","):
            if option.startswith("size="):
                return size_bytes(option[5:])
        return None

    def raw_nvidia_lines(self, host: HostGpus) -> list[tuple[str, str]]:
        """Hand-written passthrough lines: mount entries of /dev/nvidia* and the cgroup
        allow lines of a major that is the driver's now or that no driver holds any more
        (a stale one, after a kernel upgrade moved nvidia-uvm)."""
        found = []
        for key, value in self.raw:
            if (
                key == "lxc.mount.entry"
                and value.split()[:1]
                and value.split()[0].startswith("/dev/nvidia")
            ):
                found.append((key, value))
            elif key.startswith("lxc.cgroup") and key.endswith("devices.allow"):
                major = allowed_major(value)
                if major is not None and (
                    major in host.nvidia_majors() or not host.registered(major)
                ):
                    found.append((key, value))
        return found

    def stale_majors(self, host: HostGpus) -> list[int]:
        """Majors in raw allow lines that no driver holds now."""
        stale = []
        for key, value in self.raw_nvidia_lines(host):
            major = allowed_major(value) if key != "lxc.mount.entry" else None
            if major is not None and not host.registered(major):
                stale.append(major)
        return sorted(set(stale))


def allowed_major(value: str) -> int | None:
    match = _ALLOW.match(value.strip())
    return int(match.group(1)) if match and match.group(1).isdigit() else None


def shm_line(raw: list[tuple[str, str]]) -> tuple[str, str] | None:
    for key, value in raw:
        fields = value.split()
        if key == SHM_ENTRY and len(fields) >= 4 and fields[1].strip("/") == "dev/shm":
            return key, value
    return None


def shm_entry(size: int) -> tuple[str, str]:
    return SHM_ENTRY, f"tmpfs dev/shm tmpfs rw,nosuid,nodev,size={human_size(size)},create=dir 0 0"


def parse(text: str) -> CtConfig:
    """`pct config` output: `key: value` lines, raw `lxc.*` lines last."""
    config = CtConfig()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key.startswith("lxc."):
            config.raw.append((key, value))
        else:
            config.options[key] = value
    return config


def selected_gpus(host: HostGpus, gpus) -> list[int]:
    """container.gpus (all, or indices) against the GPUs the host has."""
    have = host.gpu_indices
    if gpus is None or gpus == "all":
        return have
    missing = [i for i in gpus if i not in have]
    if missing:
        raise ConfigError(
            f"container.gpus names GPU {', '.join(map(str, missing))}, which the host "
            f"does not have (it has {', '.join(map(str, have)) or 'none'})",
            hint="pick from the host's GPUs (ls /dev/nvidia[0-9]* there), or gpus: all",
        )
    return sorted(gpus)


def wanted_devices(host: HostGpus, gpus) -> list[str]:
    """One path per GPU, then nvidiactl, nvidia-uvm, nvidia-uvm-tools and the caps the
    host has (the uvm nodes even while missing: they are made on the host first)."""
    paths = [f"/dev/nvidia{i}" for i in selected_gpus(host, gpus)]
    paths.append("/dev/nvidiactl")
    paths += UVM_NODES
    paths += sorted(p for p in host.nodes if p.startswith("/dev/nvidia-caps/"))
    return paths


def device_value(path: str, gid: int | None = None) -> str:
    value = f"{path},mode={DEVICE_MODE}"
    return value if gid is None else f"{value},gid={gid}"


def missing_devices(config: CtConfig, wanted: list[str]) -> list[tuple[str, str]]:
    """(devN key, value) for each wanted path the config lacks, in free devN slots."""
    have = set(config.devices().values())
    keys = config.free_device_keys()
    return [(next(keys), device_value(path)) for path in wanted if path not in have]


def shm_need(ranks: int) -> int:
    """/dev/shm a node needs: NCCL's shared-memory transport and DataLoader workers take
    hundreds of MiB per rank; 1 GiB per rank (at least 1 GiB) leaves them room."""
    return max(1, ranks) * GIB
