# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""The test host's `pct create`, `set`, `snapshot` and `rollback` say what pve-container
says (tests/host/README.md has the table), so dflashctl's handling of them is tested
against the real texts and exit statuses."""

from __future__ import annotations

import pytest

from tests.host import oci, pve_conf, state
from tests.host.gpus import TEMPLATE_VOLUME, FakeGpuHost, pve_version

pytestmark = pytest.mark.slow
VMID = 240


@pytest.fixture
def node(pve_host):
    fake = FakeGpuHost(pve_host.state_dir)
    fake.clear()
    fake.install(gpus=1, uvm_major=509)
    yield pve_host
    ct = state.Container(pve_host.state_dir, VMID)
    if ct.exists():
        state.destroy_container(ct)
    pve_conf.conf_path(pve_host.state_dir, VMID).unlink(missing_ok=True)
    fake.clear()


def test_create_validates_as_pve_container_does(node):
    bad = node.run("pct", "create", str(VMID), TEMPLATE_VOLUME, "--cores", "x", "--bogus", "1")
    assert bad.returncode == 255
    assert "400 Parameter verification failed." in bad.stderr
    assert "cores: type check ('integer') failed - got 'x'" in bad.stderr
    assert "bogus: property is not defined in schema" in bad.stderr
    path = node.run("pct", "create", str(VMID), TEMPLATE_VOLUME, "--dev0", "/tmp/x")
    assert "dev0: invalid format - /tmp/x is not a valid device path" in path.stderr
    gone = node.run("pct", "create", str(VMID), TEMPLATE_VOLUME, "--dev0", "/dev/nvidia7")
    assert gone.returncode == 255 and "Device /dev/nvidia7 does not exist" in gone.stderr
    template = node.run("pct", "create", str(VMID), "local:vztmpl/none.tar.zst")
    assert f"unable to create CT {VMID} - volume 'local:vztmpl/none.tar.zst' does not exist" in (
        template.stderr
    )
    assert not state.Container(node.state_dir, VMID).exists()
    made = node.run("pct", "create", str(VMID), TEMPLATE_VOLUME, "--dev0", "/dev/nvidia0")
    assert made.returncode == 0, made.stderr
    again = node.run("pct", "create", str(VMID), TEMPLATE_VOLUME)
    assert f"CT {VMID} already exists on node 'pve'" in again.stderr
    config = node.run("pct", "config", str(VMID)).stdout
    assert "dev0: /dev/nvidia0\n" in config and "rootfs: local:vm-240-disk-0,size=4G" in config


def test_snapshot_needs_a_storage_that_has_them_and_rollback_restores(node):
    made = node.run("pct", "create", str(VMID), TEMPLATE_VOLUME, "--rootfs", "local:8")
    assert made.returncode == 0, made.stderr
    refused = node.run("pct", "snapshot", str(VMID), "before")
    assert refused.returncode == 255 and "snapshot feature is not available" in refused.stderr
    node.run("pct", "set", str(VMID), "--rootfs", f"local-lvm:vm-{VMID}-disk-0,size=8G")
    assert node.run("pct", "snapshot", str(VMID), "before").returncode == 0
    node.run("pct", "set", str(VMID), "--cores", "6")
    assert "cores: 6" in node.run("pct", "config", str(VMID)).stdout
    back = node.run("pct", "rollback", str(VMID), "before")
    assert back.returncode == 0, back.stderr
    conf = pve_conf.load(node.state_dir, VMID)
    assert conf.main.options["cores"] == "1" and conf.main.options["parent"] == "before"
    missing = node.run("pct", "rollback", str(VMID), "nope")
    assert "snapshot 'nope' does not exist" in missing.stderr


def test_resize_grows_only_and_takes_the_plus_form(node):
    made = node.run("pct", "create", str(VMID), TEMPLATE_VOLUME, "--rootfs", "local-lvm:8")
    assert made.returncode == 0, made.stderr
    grown = node.run("pct", "resize", str(VMID), "rootfs", "+4G")
    assert grown.returncode == 0, grown.stderr
    assert (
        f"rootfs: local-lvm:vm-{VMID}-disk-0,size=12G"
        in node.run("pct", "config", str(VMID)).stdout
    )
    shrink = node.run("pct", "resize", str(VMID), "rootfs", "10G")
    assert shrink.returncode == 255 and "unable to shrink disk size" in shrink.stderr
    same = node.run("pct", "resize", str(VMID), "rootfs", "12G")
    assert "disk is already at specified size" in same.stderr
    bad = node.run("pct", "resize", str(VMID), "rootfs", "12 GB")
    assert "size: value does not match the regex pattern" in bad.stderr
    assert node.run("pct", "resize", str(VMID), "rootfs", "12800M").returncode == 0
    assert "size=12800M" in pve_conf.load(node.state_dir, VMID).main.options["rootfs"]


def test_an_oci_archive_is_detected_on_pve_9_1_and_fails_before(node):
    cache = pve_conf.host_root(node.state_dir) / "var/lib/vz/template/cache"
    oci.make_archive(
        cache / "cuda_12.4.tar",
        {"Entrypoint": ["/opt/nvidia/entrypoint.sh"], "Cmd": ["bash"], "Env": ["PATH=/usr/bin"]},
    )
    volume = "local:vztmpl/cuda_12.4.tar"
    with pve_version(node, "8.2.4"):
        old = node.run("pct", "create", str(VMID), volume)
    assert old.returncode == 255
    assert f"unable to create CT {VMID} - unable to detect OS distribution" in old.stderr
    with pve_version(node, "9.1.1"):
        made = node.run("pct", "create", str(VMID), volume, "--net0", "name=eth0,bridge=vmbr0")
    assert made.returncode == 0, made.stderr
    assert "Detected OCI archive" in made.stdout
    conf = pve_conf.load(node.state_dir, VMID).main
    assert conf.options["entrypoint"] == "/opt/nvidia/entrypoint.sh bash"
    assert conf.options["cmode"] == "console"
    assert conf.options["net0"].endswith(",host-managed=1")
    assert ("lxc.environment.runtime", "PATH=/usr/bin") in conf.raw


def test_oci_registry_pull_stores_the_normalized_name_once(node):
    source = oci.make_archive(node.state_dir / "debian.tar", {"Cmd": ["bash"]})
    ref = "docker.io/library/debian:12"
    path = f"/nodes/{node.node}/storage/local/oci-registry-pull"
    with pve_version(node, "9.0.3", {ref: str(source)}):
        old = node.run("pvesh", "create", path, "--reference", ref)
    assert old.returncode == 255 and "no 'create' handler" in old.stderr
    with pve_version(node, "9.1.1", {ref: str(source)}):
        pulled = node.run("pvesh", "create", path, "--reference", ref)
        assert pulled.returncode == 0, pulled.stderr
        again = node.run("pvesh", "create", path, "--reference", ref)
        assert "refusing to override existing file 'debian_12.tar'" in again.stderr
        unknown = node.run("pvesh", "create", path, "--reference", "docker.io/x/none:1")
        assert unknown.returncode == 255
    listed = node.run("pvesh", "get", f"/nodes/{node.node}/storage/local/content",
                      "--output-format", "json")  # fmt: skip
    assert "local:vztmpl/debian_12.tar" in listed.stdout
