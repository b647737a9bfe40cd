# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""The test host's `pct create`, `set`, `snapshot` and `rollback` say what pve-container
says (tests/host/README.md has the table), so dflashctl's handling of them is tested
against the real texts and exit statuses."""

from __future__ import annotations

import pytest

from tests.host import pve_conf, state
from tests.host.gpus import TEMPLATE_VOLUME, FakeGpuHost

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
