"""The node's GPU side, read over SSH: the driver version, the /dev/nvidia* nodes with
their majors (from the host's /dev and /proc/devices, never assumed: the nvidia-uvm
major differs between hosts and kernels), and the changes made on the host itself
(the missing nvidia-uvm nodes, raw lines of /etc/pve/lxc/<vmid>.conf).

Every path is read under $DFLASHCTL_HOST_ROOT (unset on a real node: `/`), which the
test host points at its fake GPU files.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from dflashctl.errors import HostError
from dflashctl.remote.transport.base import Transport

UVM_NODES = ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
_PROBE = r"""R="${DFLASHCTL_HOST_ROOT:-}"
echo "== devices"; cat "$R/proc/devices" 2>/dev/null
echo "== version"; cat "$R/proc/driver/nvidia/version" 2>/dev/null
if [ -z "$R" ] && command -v nvidia-smi >/dev/null 2>&1; then
  echo "== smi"; nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1
fi
echo "== nodes"
for f in "$R"/dev/nvidia* "$R"/dev/nvidia-caps/*; do
  [ -c "$f" ] && echo "$(stat -c '%t %T' "$f") ${f#"$R"}"
done
exit 0
"""
# nvidia-modprobe -u -c=0 loads nvidia-uvm and makes its nodes (and /dev/nvidia0); where
# it is missing, the mknod it would do, with the major the running kernel gave
# nvidia-uvm in /proc/devices (minor 0 and 1, as the driver numbers them).
_MAKE_UVM = r"""R="${DFLASHCTL_HOST_ROOT:-}"
if [ -z "$R" ] && command -v nvidia-modprobe >/dev/null 2>&1 && nvidia-modprobe -u -c=0; then
  [ -c /dev/nvidia-uvm ] && [ -c /dev/nvidia-uvm-tools ] && exit 0
fi
m=$(awk '$2 == "nvidia-uvm" {print $1}' "$R/proc/devices")
if [ -z "$m" ]; then
  echo "nvidia-uvm is not loaded: no nvidia-uvm in /proc/devices (run modprobe nvidia-uvm)" >&2
  exit 1
fi
[ -c "$R/dev/nvidia-uvm" ] || mknod -m 666 "$R/dev/nvidia-uvm" c "$m" 0 || exit 1
[ -c "$R/dev/nvidia-uvm-tools" ] || mknod -m 666 "$R/dev/nvidia-uvm-tools" c "$m" 1 || exit 1
"""
_CONF = 'f="${DFLASHCTL_HOST_ROOT:-}/etc/pve/lxc/$0.conf"; '
_READ_CONF = _CONF + 'cat "$f"'
# Written as PVE's own tools write it (a temporary file renamed over it), and only if
# nobody changed it since it was read.
_WRITE_CONF = _CONF + (
    'now=$(sha256sum < "$f" | cut -d " " -f 1); '
    'if [ "$now" != "$1" ]; then echo "$f changed meanwhile: run again" >&2; exit 3; fi; '
    'cat > "$f.tmp.$$" && mv "$f.tmp.$$" "$f"'
)
_VERSION = re.compile(r"Kernel Module\s+(\d+(?:\.\d+)+)")


@dataclass
class HostGpus:
    driver_version: str | None
    nodes: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (major, minor)
    char_majors: dict[str, int] = field(default_factory=dict)  # /proc/devices name -> major

    @property
    def gpu_indices(self) -> list[int]:
        found = (re.fullmatch(r"/dev/nvidia(\d+)", path) for path in self.nodes)
        return sorted(int(m.group(1)) for m in found if m)

    @property
    def missing_uvm(self) -> list[str]:
        return [path for path in UVM_NODES if path not in self.nodes]

    @property
    def uvm_major(self) -> int | None:
        return self.char_majors.get("nvidia-uvm")

    def nvidia_majors(self) -> set[int]:
        """The majors the NVIDIA driver holds now (its nodes and /proc/devices names)."""
        majors = {major for major, _ in self.nodes.values()}
        return majors | {m for name, m in self.char_majors.items() if "nvidia" in name}

    def registered(self, major: int) -> bool:
        return major in self.char_majors.values()


def parse_probe(text: str) -> HostGpus:
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("== "):
            current = sections.setdefault(line[3:].strip(), [])
        else:
            current.append(line)
    char_majors: dict[str, int] = {}
    for line in sections.get("devices", []):
        if line.strip().lower().startswith("block devices"):
            break
        fields = line.split()
        if len(fields) == 2 and fields[0].isdigit():
            char_majors.setdefault(fields[1], int(fields[0]))
    version = None
    match = _VERSION.search("\n".join(sections.get("version", [])))
    if match:
        version = match.group(1)
    elif sections.get("smi") and sections["smi"][0].strip():
        version = sections["smi"][0].strip()
    nodes = {}
    for line in sections.get("nodes", []):
        fields = line.split(" ", 2)
        if len(fields) == 3:
            nodes[fields[2]] = (int(fields[0], 16), int(fields[1], 16))
    return HostGpus(version, nodes, char_majors)


def probe(transport: Transport) -> HostGpus:
    result = transport.run(["sh", "-c", _PROBE], check=False)
    if result.exit_status != 0:
        raise HostError(
            f"could not read the GPUs of {transport.description}: {result.last_error_line()}"
        )
    return parse_probe(result.stdout_text)


def make_uvm_nodes(transport: Transport) -> None:
    result = transport.run(["sh", "-c", _MAKE_UVM], check=False)
    if result.exit_status != 0:
        raise HostError(
            f"could not make /dev/nvidia-uvm on {transport.description}: "
            f"{result.last_error_line()}",
            hint="load the driver's uvm module on the host (modprobe nvidia-uvm), then run "
            "`nvidia-modprobe -u -c=0`",
        )


def read_conf(transport: Transport, vmid: int) -> str:
    result = transport.run(["sh", "-c", _READ_CONF, str(vmid)], check=False)
    if result.exit_status != 0:
        raise HostError(
            f"could not read /etc/pve/lxc/{vmid}.conf on {transport.description}: "
            f"{result.last_error_line()}"
        )
    return result.stdout_text


def write_conf(transport: Transport, vmid: int, old: str, new: str) -> None:
    digest = hashlib.sha256(old.encode()).hexdigest()
    result = transport.run(
        ["sh", "-c", _WRITE_CONF, str(vmid), digest], stdin=new.encode(), check=False
    )
    if result.exit_status != 0:
        raise HostError(
            f"could not write /etc/pve/lxc/{vmid}.conf on {transport.description}: "
            f"{result.last_error_line()}"
        )


def edit_raw_lines(text: str, drop, add: list[tuple[str, str]]) -> str:
    """The config file with the main section's raw `lxc.*` lines for which drop(key,
    value) is true taken out and `add` appended to that section (snapshot sections, after
    the first `[name]` line, stay as they are)."""
    lines = text.splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith("[")), len(lines))
    main, rest = lines[:end], lines[end:]
    kept = []
    for line in main:
        key, _, value = line.partition(":")
        if key.strip().startswith("lxc.") and drop(key.strip(), value.strip()):
            continue
        kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    kept += [f"{key}: {value}" for key, value in add]
    out = "\n".join(kept) + "\n"
    if rest:
        out += "\n" + "\n".join(rest) + "\n"
    return out
