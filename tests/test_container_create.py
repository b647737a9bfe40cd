# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""`dflashctl container create` and `doctor --fix` against the test host: a container
made by the stand-in's `pct create` from nothing to a passing doctor, GPUs faked at the
file level (tests/host/gpus.py: mknod'ed /dev/nvidia* with majors chosen per test, a
driver version file, a fake installer whose nvidia-smi checks itself against it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.host import pve_conf, state
from tests.host.containers import Container
from tests.host.gpus import TEMPLATE_VOLUME, FakeGpuHost, write_installer

pytestmark = pytest.mark.slow

DFLASHCTL = [sys.executable, "-m", "dflashctl"]
VMID = 230
DRIVER = "550.54.14"
NEW_DRIVER = "550.90.07"


def cli(path: Path, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASHCTL, *args, "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
    )


def said(done: subprocess.CompletedProcess) -> str:
    return done.stdout + done.stderr


@pytest.fixture
def gpu_host(pve_host):
    fake = FakeGpuHost(pve_host.state_dir)
    fake.clear()
    yield fake
    ct = state.Container(pve_host.state_dir, VMID)
    if ct.exists():
        state.destroy_container(ct)
    pve_conf.conf_path(pve_host.state_dir, VMID).unlink(missing_ok=True)
    fake.clear()


@pytest.fixture
def gpu_config(tmp_path, gpu_host, write_config, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for version in (DRIVER, NEW_DRIVER):
        write_installer(tmp_path / f"NVIDIA-Linux-x86_64-{version}.run", version)
    return write_config(
        tmp_path,
        vmid=VMID,
        **{
            "container.template": TEMPLATE_VOLUME,
            "container.gpus": "all",
            "container.shm_size": "1G",
            "container.cores": 4,
            "container.memory": 8192,
            "container.disk": 16,
            "container.nvidia_installer": str(tmp_path / "NVIDIA-Linux-x86_64-{version}.run"),
        },
    )


def conf_text(pve_host) -> str:
    return pve_conf.conf_path(pve_host.state_dir, VMID).read_text()


def handle(pve_host) -> Container:
    return Container(pve_host.state_dir, VMID)


def major_inside(ct: Container, path: str) -> int:
    done = ct.exec(["sh", "-c", f"stat -c %t {path}"])
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip(), 16)


def created(gpu_host, gpu_config, pve_host, uvm_major=509) -> Container:
    gpu_host.install(gpus=2, uvm_major=uvm_major, driver=DRIVER)
    done = cli(gpu_config, "container", "create")
    assert done.returncode == 0, said(done)
    return handle(pve_host)


def test_create_from_nothing_ends_with_a_passing_doctor(gpu_host, gpu_config, pve_host):
    gpu_host.install(gpus=2, uvm_major=507, driver=DRIVER)
    done = cli(gpu_config, "container", "create")
    assert done.returncode == 0, said(done)
    assert "all checks passed" in said(done)
    options = pve_conf.load(pve_host.state_dir, VMID).main.options
    devices = sorted(v for k, v in options.items() if k.startswith("dev"))
    assert devices == sorted(
        f"{p},mode=0666"
        for p in ("/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm",
                  "/dev/nvidia-uvm-tools")
    )  # fmt: skip
    assert options["cores"] == "4" and options["memory"] == "8192"
    assert options["rootfs"].endswith("size=16G") and options["unprivileged"] == "1"
    ct = handle(pve_host)
    assert ct.is_running()
    # The majors the container sees are the host's (507 was chosen for this test).
    assert major_inside(ct, "/dev/nvidia-uvm") == 507
    assert major_inside(ct, "/dev/nvidia1") == 195
    shm = ct.exec(["sh", "-c", "df -Pk /dev/shm | tail -n 1"]).stdout.split()
    assert int(shm[1]) == 1024 * 1024
    smi = ct.exec(["sh", "-c", ". /root/.profile; nvidia-smi -L"])
    assert smi.stdout.count("UUID: GPU-fake-") == 2, smi.stdout + smi.stderr


def test_a_second_create_changes_nothing(gpu_host, gpu_config, pve_host):
    ct = created(gpu_host, gpu_config, pve_host)
    before, init = conf_text(pve_host), ct.init_pid()
    tasks = sorted((pve_host.state_dir / "tasks").glob("*.json"))
    done = cli(gpu_config, "container", "create")
    assert done.returncode == 0, said(done)
    out = said(done)
    assert "nothing changed" in out
    assert "already: devices: /dev/nvidia0, /dev/nvidia1" in out
    assert "already: /dev/shm: 1G" in out
    assert f"already: NVIDIA user-space libraries {DRIVER}" in out
    assert "already: torch 2." in out  # its version, read from the container's python
    assert conf_text(pve_host) == before
    assert ct.init_pid() == init  # not restarted
    after = sorted((pve_host.state_dir / "tasks").glob("*.json"))
    assert [p for p in after if p not in tasks] == []  # no pct task at all


def test_dry_run_shows_every_pct_command_and_changes_nothing(gpu_host, gpu_config, pve_host):
    gpu_host.install(gpus=1, uvm_major=508, driver=DRIVER, uvm_nodes=False)
    done = cli(gpu_config, "container", "create", "--dry-run")
    assert done.returncode == 0, said(done)
    out = said(done)
    assert f"would run: pct create {VMID} {TEMPLATE_VOLUME} --hostname dflash-{VMID}" in out
    assert "--dev0 /dev/nvidia0,mode=0666 --dev1 /dev/nvidiactl,mode=0666" in out
    assert "--dev2 /dev/nvidia-uvm,mode=0666 --dev3 /dev/nvidia-uvm-tools,mode=0666" in out
    assert f"would run: pct start {VMID}" in out
    assert "nvidia-modprobe -u -c=0" in out
    assert "nothing was changed" in out
    assert not state.Container(pve_host.state_dir, VMID).exists()
    assert not pve_conf.conf_path(pve_host.state_dir, VMID).exists()
    assert gpu_host.node("/dev/nvidia-uvm") is None  # the host is untouched too


def test_driver_mismatch_is_found_and_fixed_after_a_snapshot(gpu_host, gpu_config, pve_host):
    created(gpu_host, gpu_config, pve_host)
    gpu_host.set_driver(NEW_DRIVER)  # the host driver was upgraded
    found = cli(gpu_config, "doctor")
    assert found.returncode == 3, said(found)
    assert "Driver/library version mismatch" in said(found)
    assert f"libraries are {DRIVER}, the host driver is {NEW_DRIVER}" in said(found)
    fixed = cli(gpu_config, "doctor", "--fix", "--yes")
    assert fixed.returncode == 0, said(fixed)
    assert f"pct rollback {VMID} dflashctl-fix-" in said(fixed)
    assert "all checks passed" in said(fixed)
    assert len(pve_conf.load(pve_host.state_dir, VMID).snapshots) == 1


def test_stale_uvm_major_in_raw_lines_is_rewritten_as_dev_entries(gpu_host, gpu_config, pve_host):
    ct = created(gpu_host, gpu_config, pve_host, uvm_major=509)
    # The by-hand setup: raw lines with the majors of `ls -l /dev/nvidia*` at the time.
    conf = pve_conf.load(pve_host.state_dir, VMID)
    for key in [k for k in conf.main.options if k.startswith("dev")]:
        del conf.main.options[key]
    conf.main.raw += [
        ("lxc.cgroup2.devices.allow", "c 195:* rwm"),
        ("lxc.cgroup2.devices.allow", "c 509:* rwm"),
        ("lxc.cgroup2.devices.allow", "c 10:200 rwm"),  # a tun device: not ours to touch
        ("lxc.mount.entry", "/dev/nvidia0 dev/nvidia0 none bind,optional,create=file"),
        ("lxc.mount.entry", "/dev/nvidiactl dev/nvidiactl none bind,optional,create=file"),
        ("lxc.mount.entry", "/dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file"),
    ]
    pve_conf.save(pve_host.state_dir, VMID, conf)
    gpu_host.set_uvm_major(511)  # a kernel upgrade moved nvidia-uvm
    ct.stop()
    ct.start()
    found = cli(gpu_config, "doctor")
    assert found.returncode == 3, said(found)
    assert "raw lxc lines allow major 509, which no driver holds now" in said(found)
    fixed = cli(gpu_config, "doctor", "--fix", "--yes")
    assert fixed.returncode == 0, said(fixed)
    assert "restarts" in said(fixed)
    conf = pve_conf.load(pve_host.state_dir, VMID)
    assert conf.main.raw[-1] == ("lxc.cgroup2.devices.allow", "c 10:200 rwm")
    assert not any("nvidia" in v or "509" in v or "195" in v for _, v in conf.main.raw)
    paths = {v.split(",")[0] for k, v in conf.main.options.items() if k.startswith("dev")}
    assert {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} <= paths
    assert major_inside(handle(pve_host), "/dev/nvidia-uvm") == 511
    assert cli(gpu_config, "doctor").returncode == 0


def test_missing_uvm_nodes_on_the_host_are_made_with_the_kernels_major(
    gpu_host, gpu_config, pve_host
):
    created(gpu_host, gpu_config, pve_host, uvm_major=505)
    gpu_host.set_uvm_major(512, make_nodes=False)  # after a reboot, before any CUDA use
    found = cli(gpu_config, "doctor")
    assert found.returncode == 3, said(found)
    assert "/dev/nvidia-uvm, /dev/nvidia-uvm-tools missing on the host" in said(found)
    fixed = cli(gpu_config, "doctor", "--fix", "--yes")
    assert fixed.returncode == 0, said(fixed)
    assert gpu_host.node("/dev/nvidia-uvm") == (512, 0)
    assert gpu_host.node("/dev/nvidia-uvm-tools") == (512, 1)
    assert major_inside(handle(pve_host), "/dev/nvidia-uvm-tools") == 512


def test_small_shm_is_found_and_fixed_without_a_snapshot_where_storage_has_none(
    gpu_host, gpu_config, pve_host, write_config, tmp_path
):
    ct = created(gpu_host, gpu_config, pve_host)
    conf = pve_conf.load(pve_host.state_dir, VMID)
    conf.main.options["rootfs"] = f"local:{VMID}/vm-{VMID}-disk-0.raw,size=16G"  # a dir storage
    conf.main.raw = [
        (k, v.replace("size=1G", "size=64M")) if "dev/shm" in v else (k, v)
        for k, v in conf.main.raw
    ]
    pve_conf.save(pve_host.state_dir, VMID, conf)
    ct.stop()
    ct.start()
    found = cli(gpu_config, "doctor")
    assert found.returncode == 3, said(found)
    assert "/dev/shm is 64.0 MiB, 2 rank(s) need 1.0 GiB" in said(found)
    fixed = cli(gpu_config, "doctor", "--fix", "--yes")
    assert fixed.returncode == 0, said(fixed)
    assert "no snapshot: the storage of container" in said(fixed)
    shm = ct.exec(["sh", "-c", "df -Pk /dev/shm | tail -n 1"]).stdout.split()
    assert int(shm[1]) == 1024 * 1024


def test_a_refused_fix_leaves_the_container_untouched(gpu_host, gpu_config, pve_host):
    ct = created(gpu_host, gpu_config, pve_host)
    conf = pve_conf.load(pve_host.state_dir, VMID)
    conf.main.raw = [
        (k, v.replace("size=1G", "size=64M")) if "dev/shm" in v else (k, v)
        for k, v in conf.main.raw
    ]
    pve_conf.save(pve_host.state_dir, VMID, conf)
    ct.stop()
    ct.start()
    gpu_host.set_driver(NEW_DRIVER)
    before, init = conf_text(pve_host), ct.init_pid()
    smi_before = (ct.root / "bin" / "nvidia-smi").read_text()
    refused = cli(gpu_config, "doctor", "--fix", input="n\nn\n")
    assert refused.returncode == 3, said(refused)
    assert said(refused).count("left as it is") == 2
    assert conf_text(pve_host) == before  # no snapshot section, no new line
    assert ct.init_pid() == init
    assert (ct.root / "bin" / "nvidia-smi").read_text() == smi_before
