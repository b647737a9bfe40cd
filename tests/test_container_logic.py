"""The GPU container logic without a host: reading the node's GPUs, which raw lxc lines
are NVIDIA's and stale, the devN entries wanted, editing the config file's main section."""

from __future__ import annotations

import pytest

from dflashctl.container import ctconfig, host, inside
from dflashctl.errors import ConfigError

PROBE = """== devices
Character devices:
  1 mem
 10 misc
195 nvidia-frontend
195 nvidiactl
511 nvidia-uvm
236 nvidia-caps

Block devices:
  7 loop
259 blkext
== version
NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024
GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)
== nodes
c3 0 /dev/nvidia0
c3 1 /dev/nvidia1
c3 ff /dev/nvidiactl
1ff 0 /dev/nvidia-uvm
ec 1 /dev/nvidia-caps/nvidia-cap1
"""


def test_the_host_probe_reads_majors_from_the_host_not_a_table():
    gpus = host.parse_probe(PROBE)
    assert gpus.driver_version == "550.54.14"
    assert gpus.gpu_indices == [0, 1]
    assert gpus.nodes["/dev/nvidia-uvm"] == (511, 0)
    assert gpus.uvm_major == 511
    assert gpus.missing_uvm == ["/dev/nvidia-uvm-tools"]
    assert "blkext" not in gpus.char_majors


def test_the_driver_version_falls_back_to_nvidia_smi():
    gpus = host.parse_probe("== smi\n535.183.01\n== nodes\nc3 0 /dev/nvidia0\n")
    assert gpus.driver_version == "535.183.01"


def test_stale_and_current_raw_lines_are_nvidias_and_tun_is_not():
    gpus = host.parse_probe(PROBE)
    config = ctconfig.parse(
        "cores: 8\ndev0: /dev/nvidia0,mode=0666\n"
        "lxc.cgroup2.devices.allow: c 195:* rwm\n"
        "lxc.cgroup2.devices.allow: c 509:* rwm\n"
        "lxc.cgroup2.devices.allow: c 10:200 rwm\n"
        "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file\n"
        "lxc.mount.entry: /dev/net dev/net none bind,create=dir\n"
    )
    assert config.stale_majors(gpus) == [509]
    assert [v for _, v in config.raw_nvidia_lines(gpus)] == [
        "c 195:* rwm",
        "c 509:* rwm",
        "/dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file",
    ]
    assert config.devices() == {"dev0": "/dev/nvidia0"}


def test_wanted_devices_follow_the_gpu_selection_and_free_slots():
    gpus = host.parse_probe(PROBE)
    wanted = ctconfig.wanted_devices(gpus, [1])
    assert wanted == [
        "/dev/nvidia1",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-caps/nvidia-cap1",
    ]
    config = ctconfig.parse("dev0: /dev/nvidiactl,mode=0666\ndev2: /dev/dri/card0\n")
    missing = ctconfig.missing_devices(config, wanted)
    assert [k for k, _ in missing] == ["dev1", "dev3", "dev4", "dev5"]
    with pytest.raises(ConfigError, match="GPU 4, which the host does not have"):
        ctconfig.wanted_devices(gpus, [0, 4])


def test_raw_line_edits_keep_the_snapshot_sections():
    text = (
        "cores: 8\nlxc.mount.entry: tmpfs dev/shm tmpfs size=64M,create=dir 0 0\n"
        "lxc.cgroup2.devices.allow: c 10:200 rwm\n\n[before]\ncores: 4\n"
        "lxc.mount.entry: tmpfs dev/shm tmpfs size=64M,create=dir 0 0\n"
    )
    shm = ctconfig.shm_entry(16 << 30)
    edited = host.edit_raw_lines(text, lambda k, v: "dev/shm" in v, [shm])
    main, snapshot = edited.split("[before]")
    assert "size=64M" not in main and "size=16G" in main
    assert "c 10:200 rwm" in main
    assert "size=64M" in snapshot


def test_the_container_library_version_comes_from_its_nvidia_smi():
    seen = inside.parse(
        "node c3 0 /dev/nvidia0\nshm 65536\n"
        "smi 18 Failed to initialize NVML: Driver/library version mismatch "
        "NVML library version: 535.104\ntorch -\n"
    )
    assert seen.nodes == {"/dev/nvidia0": (195, 0)}
    assert seen.shm_bytes == 64 << 20
    assert seen.library_version == "535.104" and not seen.libraries_match("550.54.14")
    assert "mismatch" in seen.library_problem("550.54.14") and seen.torch is None
    ok = inside.parse("smi 0 550.54.14 550.54.14\ntorch 2.5.1\n")
    assert ok.libraries_match("550.54.14") and ok.torch == "2.5.1"


def test_run_gpus_sets_cuda_visible_devices_nproc_and_meta(tmp_path):
    from dflashctl.config.schema import parse_config
    from dflashctl.ops.launch_command import nproc_per_node
    from dflashctl.ops.launching import launch_params

    def config(**run):
        text = "host: {address: local}\ncontainer: {vmid: null}\n"
        text += f"run: {run!r}\n".replace("'", '"')
        (tmp_path / "trainer").mkdir(exist_ok=True)
        return parse_config(text, tmp_path / "dflash.yaml")

    chosen = config(gpus=[2, 3])
    params = launch_params(chosen, "r1", None, ["python3", "train.py"], {})
    assert params["env"]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert params["meta"]["gpus"] == [2, 3]
    assert nproc_per_node(chosen) == 2
    every = config()
    assert "CUDA_VISIBLE_DEVICES" not in launch_params(every, "r1", None, [], {})["env"]
    assert nproc_per_node(every) == "gpu"
    with pytest.raises(ConfigError, match="distinct whole numbers"):
        config(gpus=[1, 1])


def test_container_template_takes_a_volume_or_an_oci_reference():
    from dflashctl.container import oci

    assert oci.is_volume("local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst")
    assert oci.is_volume("nas:vztmpl/cuda_12.4.1-base-ubuntu22.04.tar")
    ref = oci.reference_of("docker://docker.io/nvidia/cuda:12.4.1-base-ubuntu22.04")
    assert ref == "docker.io/nvidia/cuda:12.4.1-base-ubuntu22.04"
    # pve-storage's normalize_content_filename, then .tar
    assert oci.pulled_volume(ref) == "local:vztmpl/cuda_12.4.1-base-ubuntu22.04.tar"
    assert oci.pulled_volume("registry.lan:5000/team/img:v2") == "local:vztmpl/img_v2.tar"
    for bad in ("docker.io/library/debian", "Debian:12", "local:iso/x.iso"):
        with pytest.raises(ConfigError, match="neither a CT template volume nor an OCI image"):
            oci.reference_of(bad)
    assert oci.version_tuple("9.1.1") >= oci.OCI_RELEASE > oci.version_tuple("9.0.11")


def _probe_torch(python: str, pythonpath: str | None = None) -> str | None:
    """The probe script itself, run here with `python` as the container's interpreter."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run(
        ["sh", "-c", inside._PROBE, python], capture_output=True, text=True, env=env, timeout=120
    )
    return inside.parse(done.stdout).torch


def test_the_probe_finds_torch_by_its_metadata_by_import_or_not_at_all(tmp_path):
    import sys

    import torch

    assert _probe_torch(sys.executable) == torch.__version__  # its metadata
    # An interpreter that sees no site-packages: no torch at all ...
    bare = tmp_path / "python-bare"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    assert _probe_torch(str(bare)) is None
    # ... and a torch without metadata on PYTHONPATH (a source tree) is found by importing it.
    (tmp_path / "src" / "torch").mkdir(parents=True)
    (tmp_path / "src" / "torch" / "__init__.py").write_text('__version__ = "9.9.0a0+git1"\n')
    assert _probe_torch(str(bare), str(tmp_path / "src")) == "9.9.0a0+git1"
