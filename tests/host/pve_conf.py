"""The stand-in node's container configs in Proxmox's own file format, and its host root.

A container made with the stand-in's `pct create` (or changed with `pct set`) has its
configuration in `<host root>/etc/pve/lxc/<vmid>.conf`, written as pve-container writes
`/etc/pve/lxc/<vmid>.conf` (src/PVE/LXC/Config.pm, write_pct_config): `key: value` lines,
raw `lxc.*` lines after the options, then one `[snapshot]` section per snapshot. The host
root (`$FAKEPVE_STATE/host-root`, given to sessions as DFLASHCTL_HOST_ROOT) stands for
the node's `/`: its `dev/nvidia*` (made with mknod by the tests, majors chosen per test),
`proc/devices`, `proc/driver/nvidia/version` and `etc/pve`.

Containers that the fixtures make directly (state.create_container) have no such file
and keep the fixed configuration state.Container.pve_config shows.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

HOST_ROOT_ENV = "DFLASHCTL_HOST_ROOT"
_SECTION = re.compile(r"^\[([A-Za-z][A-Za-z0-9_\-]*)\]\s*$")


def host_root(state_root: Path) -> Path:
    return Path(state_root) / "host-root"


def conf_path(state_root: Path, vmid: int) -> Path:
    return host_root(state_root) / "etc" / "pve" / "lxc" / f"{vmid}.conf"


@dataclass
class Section:
    options: dict[str, str] = field(default_factory=dict)
    raw: list[tuple[str, str]] = field(default_factory=list)  # (lxc.key, value), in order

    def lines(self) -> list[str]:
        out = [f"{key}: {self.options[key]}" for key in sorted(self.options)]
        return out + [f"{key}: {value}" for key, value in self.raw]


@dataclass
class PveConf:
    main: Section
    snapshots: dict[str, Section]

    def text(self) -> str:
        parts = ["\n".join(self.main.lines())]
        for name, section in self.snapshots.items():
            parts.append(f"[{name}]\n" + "\n".join(section.lines()))
        return "\n\n".join(parts) + "\n"


def parse(text: str) -> PveConf:
    main = Section()
    snapshots: dict[str, Section] = {}
    current = main
    for line in text.splitlines():
        line = line.rstrip()
        if not line or line.startswith("#"):
            continue
        header = _SECTION.match(line)
        if header:
            current = snapshots.setdefault(header.group(1), Section())
            continue
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key.startswith("lxc."):
            current.raw.append((key, value))
        else:
            current.options[key] = value
    return PveConf(main, snapshots)


def load(state_root: Path, vmid: int) -> PveConf | None:
    path = conf_path(state_root, vmid)
    try:
        return parse(path.read_text())
    except FileNotFoundError:
        return None


def save(state_root: Path, vmid: int, conf: PveConf) -> None:
    path = conf_path(state_root, vmid)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    temporary.write_text(conf.text())
    temporary.rename(path)


def device_on_host(state_root: Path, path: str) -> Path:
    """PVE::LXC::Tools::get_device_mode_and_rdev, on the host root: the device node, or
    its die text."""
    node = host_root(state_root) / path.lstrip("/")
    try:
        mode = node.stat().st_mode
    except FileNotFoundError:
        raise LookupError(f"Device {path} does not exist") from None
    if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
        raise LookupError(f"{path} is not a device")
    return node


def parse_device(value: str) -> dict[str, str]:
    """A devN property string (`/dev/x,mode=0666,gid=44`) as pve-container reads it
    (Config.pm: $dev_desc, verify_lxc_dev_string, parse_device); ValueError with its text."""
    fields: dict[str, str] = {}
    for part in value.split(","):
        key, has_value, item = part.partition("=")
        if not has_value:
            key, item = "path", part
        if key not in ("path", "mode", "uid", "gid", "deny-write"):
            raise ValueError(f"invalid format - unknown property '{key}'")
        fields[key] = item
    path = fields.get("path")
    if path is None:
        raise ValueError("Path has to be defined")
    if re.search(r"/\.\.?(?:/|$)", path) or not path.startswith("/dev/"):
        raise ValueError(f"invalid format - {path} is not a valid device path")
    if "mode" in fields and not re.fullmatch(r"0[0-7]{3}", fields["mode"]):
        raise ValueError("invalid format - mode: value does not match the regex pattern")
    for key in ("uid", "gid"):
        if key in fields and not fields[key].isdigit():
            raise ValueError(f"invalid format - {key}: type check ('integer') failed")
    return fields


def shm_size_bytes(raw: list[tuple[str, str]]) -> int | None:
    """The size= of a raw `lxc.mount.entry: tmpfs dev/shm tmpfs ...size=N...` line."""
    for key, value in raw:
        fields = value.split()
        if key == "lxc.mount.entry" and len(fields) >= 4 and fields[1].strip("/") == "dev/shm":
            for option in fields[3].split(","):
                if option.startswith("size="):
                    return _size(option[5:])
    return None


def _size(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    match = re.fullmatch(r"(\d+)([kKmMgGtT]?)", text)
    if not match:
        raise ValueError(f"bad size {text!r}")
    return int(match.group(1)) * units[match.group(2).lower()]


def passthrough(state_root: Path, conf: PveConf) -> list[tuple[Path, str]]:
    """(node on the host root, path in the container) for each devN entry and each raw
    `lxc.mount.entry` binding a host /dev node; a devN whose node is missing stops the
    start with pve-container's text (LookupError), a raw entry marked `optional` does not."""
    binds: list[tuple[Path, str]] = []
    for key in sorted(conf.main.options, key=lambda k: (len(k), k)):
        if re.fullmatch(r"dev\d+", key):
            path = parse_device(conf.main.options[key])["path"]
            binds.append((device_on_host(state_root, path), path))
    for key, value in conf.main.raw:
        fields = value.split()
        if key != "lxc.mount.entry" or len(fields) < 4 or not fields[0].startswith("/dev/"):
            continue
        try:
            node = device_on_host(state_root, fields[0])
        except LookupError:
            if "optional" in fields[3].split(","):
                continue
            raise
        binds.append((node, "/" + fields[1].lstrip("/")))
    return binds
