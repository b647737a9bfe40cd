# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""`dflashctl container create` from an OCI image (PVE 9.1), growing the root disk of an
existing container, and `doctor --fix` for the ranks of one host split over several
containers; against the test host as in test_container_create.py."""

from __future__ import annotations

import pytest
import yaml

from tests.host import oci, pve_conf, state
from tests.host.gpus import pve_version
from tests.test_container_create import (
    DRIVER,
    VMID,
    cli,
    conf_text,
    created,
    gpu_config,  # noqa: F401  (a fixture)
    gpu_host,  # noqa: F401  (a fixture)
    handle,
    major_inside,
    said,
)

pytestmark = pytest.mark.slow
CUDA = "docker.io/nvidia/cuda:12.4.1-base-ubuntu22.04"
CUDA_VOLUME = "local:vztmpl/cuda_12.4.1-base-ubuntu22.04.tar"
OTHER = VMID + 1


def rewrite(path, **container) -> None:
    config = yaml.safe_load(path.read_text())
    config["container"].update(container)
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def pulled(pve_host):
    return (
        pve_conf.host_root(pve_host.state_dir)
        / "var/lib/vz/template/cache"
        / (CUDA_VOLUME.rpartition("/")[2])
    )


def test_an_oci_image_is_pulled_and_created_from_on_pve_9_1(
    gpu_host, gpu_config, pve_host, tmp_path
):
    gpu_host.install(gpus=1, uvm_major=509, driver=DRIVER)
    rewrite(gpu_config, template=CUDA)
    image = oci.make_archive(
        tmp_path / "cuda.tar",
        {"Entrypoint": ["/opt/nvidia/nvidia_entrypoint.sh"], "Env": ["NVIDIA_VISIBLE_DEVICES=all"]},
    )
    try:
        with pve_version(pve_host, "9.1.1", {CUDA: str(image)}):
            dry = cli(gpu_config, "container", "create", "--dry-run")
            assert dry.returncode == 0, said(dry)
            assert (
                f"would run: pvesh create /nodes/{pve_host.node}/storage/local/"
                f"oci-registry-pull --reference {CUDA}"
            ) in said(dry)
            assert f"would run: pct create {VMID} {CUDA_VOLUME} --hostname" in said(dry)
            assert not pulled(pve_host).exists()  # the dry run pulled nothing
            done = cli(gpu_config, "container", "create")
            assert done.returncode == 0, said(done)
            assert "all checks passed" in said(done)
            conf = pve_conf.load(pve_host.state_dir, VMID).main
            # pct detected the OCI archive and took the image's entrypoint and env
            assert conf.options["entrypoint"] == "/opt/nvidia/nvidia_entrypoint.sh"
            assert ("lxc.environment.runtime", "NVIDIA_VISIBLE_DEVICES=all") in conf.raw
            assert major_inside(handle(pve_host), "/dev/nvidia0") == 195
            again = cli(gpu_config, "container", "create")
            assert again.returncode == 0 and "nothing changed" in said(again), said(again)
    finally:
        pulled(pve_host).unlink(missing_ok=True)


def test_an_oci_image_on_an_older_pve_is_refused_naming_the_version(
    gpu_host, gpu_config, pve_host, tmp_path
):
    gpu_host.install(gpus=1, uvm_major=509, driver=DRIVER)
    rewrite(gpu_config, template=CUDA)
    with pve_version(pve_host, "9.0.11", {CUDA: str(oci.make_archive(tmp_path / "c.tar", {}))}):
        for args in (("--dry-run",), ()):
            refused = cli(gpu_config, "container", "create", *args)
            assert refused.returncode == 2, said(refused)
            out = " ".join(said(refused).split())
            assert "creating containers from OCI images needs Proxmox VE 9.1 or later" in out
            assert "runs 9.0.11" in out
    assert not state.Container(pve_host.state_dir, VMID).exists()
    assert not pulled(pve_host).exists()


def test_a_second_create_grows_the_root_disk_and_never_shrinks_it(gpu_host, gpu_config, pve_host):
    ct = created(gpu_host, gpu_config, pve_host)  # container.disk 16
    init = ct.init_pid()
    rewrite(gpu_config, disk=24)
    dry = cli(gpu_config, "container", "create", "--dry-run")
    assert dry.returncode == 0, said(dry)
    assert f"would run: pct resize {VMID} rootfs 24G" in said(dry)
    assert "size=16G" in pve_conf.load(pve_host.state_dir, VMID).main.options["rootfs"]
    grown = cli(gpu_config, "container", "create")
    assert grown.returncode == 0, said(grown)
    assert "grow the root disk 16G -> 24G" in said(grown)
    assert pve_conf.load(pve_host.state_dir, VMID).main.options["rootfs"].endswith("size=24G")
    assert ct.init_pid() == init  # grown online, not restarted
    rewrite(gpu_config, disk=8)
    before = conf_text(pve_host)
    kept = cli(gpu_config, "container", "create")
    assert kept.returncode == 0, said(kept)
    out = " ".join(said(kept).split())
    assert "Proxmox cannot shrink a container's disk, so it stays 24G" in out
    assert "pct resize" not in out
    assert conf_text(pve_host) == before


@pytest.fixture
def split_config(gpu_config, pve_host):
    """Two nodes on the one test host: container 230 with GPU 0, 231 with GPU 1."""
    config = yaml.safe_load(gpu_config.read_text())
    config["nodes"] = [
        {"host": {"address": pve_host.address, "port": pve_host.port},
         "container": {"vmid": vmid, "gpus": [gpu]}}
        for vmid, gpu in ((VMID, 0), (OTHER, 1))
    ]  # fmt: skip
    config["torchrun"] = {"nproc_per_node": 1}
    gpu_config.write_text(yaml.safe_dump(config, sort_keys=False))
    yield gpu_config
    ct = state.Container(pve_host.state_dir, OTHER)
    if ct.exists():
        state.destroy_container(ct)
    pve_conf.conf_path(pve_host.state_dir, OTHER).unlink(missing_ok=True)


def gpu_paths(pve_host, vmid: int) -> set[str]:
    options = pve_conf.load(pve_host.state_dir, vmid).main.options
    return {v.split(",")[0] for k, v in options.items() if k.startswith("dev")}


def test_ranks_split_over_containers_get_one_container_with_every_gpu(
    gpu_host, split_config, pve_host
):
    gpu_host.install(gpus=2, uvm_major=509, driver=DRIVER)
    made = cli(split_config, "container", "create")
    assert state.Container(pve_host.state_dir, OTHER).exists(), said(made)
    assert "/dev/nvidia1" not in gpu_paths(pve_host, VMID)
    before = (conf_text(pve_host), pve_conf.conf_path(pve_host.state_dir, OTHER).read_text())
    refused = cli(split_config, "doctor", "--fix", input="n\n")
    assert refused.returncode == 3, said(refused)
    out = " ".join(said(refused).split())
    assert f"ranks of one host split over several containers: {VMID} (GPU 0), {OTHER} (GPU 1)" in (
        out
    )
    assert "left as it is" in out
    after = (conf_text(pve_host), pve_conf.conf_path(pve_host.state_dir, OTHER).read_text())
    assert after == before  # no snapshot, no device
    fixed = cli(split_config, "doctor", "--fix", "--yes")
    out = " ".join(said(fixed).split())
    assert f"pct rollback {VMID} dflashctl-fix-" in out
    assert "torchrun.nproc_per_node: 2" in out and f"drop the nodes of container {OTHER}" in out
    assert {"/dev/nvidia0", "/dev/nvidia1"} <= gpu_paths(pve_host, VMID)
    assert len(pve_conf.load(pve_host.state_dir, VMID).snapshots) == 1
    # the other container is neither deleted nor changed
    assert pve_conf.conf_path(pve_host.state_dir, OTHER).read_text() == before[1]
    assert major_inside(handle(pve_host), "/dev/nvidia1") == 195  # applied at the restart
