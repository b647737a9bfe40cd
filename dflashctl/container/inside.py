"""What the container sees of its GPUs: the device nodes and their majors, the size of
/dev/shm, the version of its NVIDIA user-space libraries (from its nvidia-smi, which
fails with `Driver/library version mismatch` when they are not the host driver's), and
whether torch is installed. One shell script, one `pct exec`."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from dflashctl.remote.deploy_target import Target

# torch's version from its package metadata, not an import: importing it costs ~3 s of
# every probe; whether it imports and sees CUDA is the doctor's check, run after. A torch
# without metadata (a source tree on PYTHONPATH, Python < 3.8) is still found by importing.
_PROBE = r"""for f in /dev/nvidia* /dev/nvidia-caps/*; do
  [ -c "$f" ] && echo "node $(stat -c '%t %T' "$f") $f"
done
echo "shm $(df -Pk /dev/shm 2>/dev/null | tail -n 1 | awk '{print $2}')"
out=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1)
echo "smi $? $(echo "$out" | tr '\n' ' ')"
"$0" -c 'from importlib.metadata import version; print("torch", version("torch"))' \
  2>/dev/null || "$0" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null \
  || echo "torch -"
"""
_LIBRARY = re.compile(r"NVML library version:\s*([0-9.]+)")


@dataclass
class Inside:
    nodes: dict[str, tuple[int, int]] = field(default_factory=dict)
    shm_bytes: int | None = None
    smi_status: int = 127
    smi_output: str = ""
    torch: str | None = None

    @property
    def library_version(self) -> str | None:
        """The version of its NVIDIA user-space libraries, when nvidia-smi says it."""
        if self.smi_status == 0:
            return self.smi_output.split()[0] if self.smi_output.split() else None
        match = _LIBRARY.search(self.smi_output)
        return match.group(1) if match else None

    def libraries_match(self, host_version: str) -> bool:
        return self.smi_status == 0 and self.library_version == host_version

    def library_problem(self, host_version: str) -> str:
        if self.smi_status in (126, 127):
            return "no NVIDIA user-space libraries (nvidia-smi is not installed there)"
        if "mismatch" in self.smi_output:
            found = self.library_version
            return (
                f"Driver/library version mismatch: its libraries are {found or 'another version'}, "
                f"the host driver is {host_version}"
            )
        if self.smi_status == 0:
            return f"its libraries are {self.library_version}, the host driver is {host_version}"
        return f"nvidia-smi fails there: {self.smi_output.strip() or f'exit {self.smi_status}'}"


def parse(text: str) -> Inside:
    inside = Inside()
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "node":
            major, minor, path = rest.split(" ", 2)
            inside.nodes[path] = (int(major, 16), int(minor, 16))
        elif kind == "shm" and rest.strip().isdigit():
            inside.shm_bytes = int(rest.strip()) * 1024
        elif kind == "smi":
            status, _, output = rest.partition(" ")
            inside.smi_status, inside.smi_output = int(status), output.strip()
        elif kind == "torch" and rest.strip() != "-":
            inside.torch = rest.strip()
    return inside


def probe(target: Target, python: str) -> Inside:
    result = target.run(["sh", "-c", _PROBE, python], timeout=120, check=False)
    return parse(result.stdout_text)


def install_script(installer: str, local: bool) -> str:
    """The shell script that installs the NVIDIA user-space libraries in the container:
    the installer fetched there (or already sent there), run without its kernel module
    (the host's driver is the one in use)."""
    dest = "/tmp/dflashctl-nvidia-installer.run"
    fetch = (
        ""
        if local
        else f"(curl -fsSL -o {dest} {shlex.quote(installer)} || "
        f"wget -q -O {dest} {shlex.quote(installer)}) || exit 1; "
    )
    return (
        f"{fetch}sh {dest} --silent --no-kernel-module --no-questions --ui=none; "
        f"s=$?; rm -f {dest}; exit $s"
    )
