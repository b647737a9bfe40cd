"""A fake NVIDIA GPU host, at the file level, under the test host's host root.

`FakeGpuHost(state_dir).install(gpus=2, uvm_major=509, driver="550.54.14")` makes
`dev/nvidia0..N`, `dev/nvidiactl` (major 195) and `dev/nvidia-uvm`, `-tools` (the
uvm major chosen per test) with mknod, the `proc/devices` lines that name those majors,
`proc/driver/nvidia/version`, and a CT template under `var/lib/vz/template/cache/`.
`installer(path, version)` writes a fake NVIDIA `.run` installer: run in a container
with `--no-kernel-module`, it installs a fake `nvidia-smi` of that library version in
/root/bin (a writable place of the test containers; ~/.profile puts it on a login's
PATH), which compares itself with the host driver's version file as the real one
compares NVML with the kernel module: `Failed to initialize NVML: Driver/library
version mismatch` (exit 18) when they differ.

The device nodes are never opened: the stand-in binds them into the containers
(state.gpu_passthrough), where dflashctl reads their majors.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from pathlib import Path

from . import pve_conf

NVIDIA_MAJOR = 195  # the driver's fixed major (nvidia-frontend / nvidiactl)
TEMPLATE = "debian-12-standard_12.7-1_amd64.tar.zst"
TEMPLATE_VOLUME = f"local:vztmpl/{TEMPLATE}"

_SMI = r"""#!/bin/sh
# fake nvidia-smi of user-space library version @LIB@ (tests/host/gpus.py)
LIB=@LIB@
K=$(sed -n 's/.*Kernel Module  *\([0-9.]*\).*/\1/p' /dev/.fake-nvidia-driver/version 2>/dev/null)
if [ -z "$K" ]; then
  echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
  exit 9
fi
if [ "$K" != "$LIB" ]; then
  echo "Failed to initialize NVML: Driver/library version mismatch"
  echo "NVML library version: $LIB"
  exit 18
fi
i=0
for d in /dev/nvidia[0-9]*; do
  [ -c "$d" ] || continue
  case "$*" in
    *driver_version*) echo "$K" ;;
    *) echo "GPU $i: NVIDIA Fake GPU (UUID: GPU-fake-$i)" ;;
  esac
  i=$((i + 1))
done
"""

_INSTALLER = r"""#!/bin/sh
# fake NVIDIA-Linux-x86_64-@LIB@.run: user-space libraries only (tests/host/gpus.py)
case " $* " in *" --no-kernel-module "*) ;; *)
  echo "ERROR: Unable to load the kernel module 'nvidia.ko' (run with --no-kernel-module)" >&2
  exit 1 ;;
esac
mkdir -p /root/bin
cat > /root/bin/nvidia-smi <<'EOF'
@SMI@EOF
chmod 755 /root/bin/nvidia-smi
grep -q 'root/bin' /root/.profile 2>/dev/null || echo 'PATH="$HOME/bin:$PATH"' >> /root/.profile
echo "Installation of the NVIDIA Accelerated Graphics Driver for Linux-x86_64 (version: @LIB@) is now complete."
"""


class FakeGpuHost:
    def __init__(self, state_dir: Path):
        self.root = pve_conf.host_root(state_dir)

    def install(self, gpus: int = 2, uvm_major: int = 509, driver: str = "550.54.14", *,
                uvm_nodes: bool = True, caps: bool = False) -> None:  # fmt: skip
        dev = self.root / "dev"
        dev.mkdir(parents=True, exist_ok=True)
        for index in range(gpus):
            self._node(dev / f"nvidia{index}", NVIDIA_MAJOR, index)
        self._node(dev / "nvidiactl", NVIDIA_MAJOR, 255)
        if caps:
            (dev / "nvidia-caps").mkdir(exist_ok=True)
            self._node(dev / "nvidia-caps" / "nvidia-cap1", uvm_major + 1, 1)
            self._node(dev / "nvidia-caps" / "nvidia-cap2", uvm_major + 1, 2)
        self.set_uvm_major(uvm_major, make_nodes=uvm_nodes)
        self.set_driver(driver)
        cache = self.root / "var/lib/vz/template/cache"
        cache.mkdir(parents=True, exist_ok=True)
        (cache / TEMPLATE).write_bytes(b"fake template\n")

    def set_uvm_major(self, major: int, *, make_nodes: bool = True) -> None:
        """A kernel whose nvidia-uvm got `major` (as after an upgrade)."""
        proc = self.root / "proc"
        proc.mkdir(parents=True, exist_ok=True)
        (proc / "devices").write_text(
            "Character devices:\n  1 mem\n  4 /dev/vc/0\n  5 /dev/tty\n 10 misc\n"
            f"{NVIDIA_MAJOR} nvidia-frontend\n{major} nvidia-uvm\n{major + 1} nvidia-caps\n"
            "\nBlock devices:\n  7 loop\n  8 sd\n"
        )
        for name in ("nvidia-uvm", "nvidia-uvm-tools"):
            (self.root / "dev" / name).unlink(missing_ok=True)
        if make_nodes:
            self._node(self.root / "dev" / "nvidia-uvm", major, 0)
            self._node(self.root / "dev" / "nvidia-uvm-tools", major, 1)

    def set_driver(self, version: str) -> None:
        folder = self.root / "proc" / "driver" / "nvidia"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "version").write_text(
            f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  "
            "Thu Feb 22 01:44:30 UTC 2024\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
        )

    def node(self, path: str) -> tuple[int, int] | None:
        try:
            rdev = (self.root / path.lstrip("/")).stat().st_rdev
        except FileNotFoundError:
            return None
        return os.major(rdev), os.minor(rdev)

    def clear(self) -> None:
        for name in ("dev", "proc", "var"):
            shutil.rmtree(self.root / name, ignore_errors=True)

    @staticmethod
    def _node(path: Path, major: int, minor: int) -> None:
        path.unlink(missing_ok=True)
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))


def write_installer(path: Path, version: str) -> Path:
    smi = _SMI.replace("@LIB@", version)
    path.write_text(_INSTALLER.replace("@SMI@", smi).replace("@LIB@", version))
    path.chmod(0o755)
    return path


@contextlib.contextmanager
def pve_version(host, version: str, registry: dict[str, str] | None = None):
    """The node runs PVE `version` (pvesh get /version, what pct create accepts) with an
    OCI registry of {reference: archive path} (tests/host/oci.py), until the block ends."""
    settings_file = Path(host.state_dir) / "host.json"
    before = settings_file.read_text()
    settings = json.loads(before)
    settings["pve_version"] = version
    settings["oci_registry"] = registry or {}
    settings_file.write_text(json.dumps(settings))
    try:
        yield
    finally:
        settings_file.write_text(before)
