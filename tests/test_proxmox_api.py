"""Container state through proxmoxer, with pvesh over dflashctl's own SSH connection."""

from __future__ import annotations

import paramiko
import pytest

from dflashctl.config.schema import load_config
from dflashctl.errors import EXIT_HOST, EXIT_USAGE, ConfigError, HostError
from dflashctl.remote import proxmox
from dflashctl.remote.connect import connect
from dflashctl.remote.pct import ContainerNotFound, ContainerNotRunning
from dflashctl.remote.transport import LocalTransport


@pytest.fixture
def config(pve_host, write_config, tmp_path):
    return load_config(write_config(tmp_path))


def logins(pve_host) -> int:
    return pve_host.log_tail(10_000_000).count("Accepted publickey for root")


def test_status_of_a_running_container_over_the_same_connection(pve_host, config, container):
    before = logins(pve_host)
    with connect(config) as (transport, api, target):
        status = proxmox.container_status(api, "pve", 200)
        assert (status.vmid, status.status, status.name) == (200, "running", "ct200")
        assert status.running and status.uptime_s >= 0
        assert proxmox.api_version(api) == "8.2.4"
        assert target.run(["hostname"]).stdout_text == "ct200\n"
    assert logins(pve_host) == before + 1  # pvesh and pct exec shared one connection


def test_list_and_a_stopped_container(config, make_container):
    make_container(200)
    make_container(205, running=False, hostname="idle")
    with connect(config) as (_, api, _):
        listed = [proxmox.container_status(api, "pve", vmid) for vmid in (200, 205)]
    assert [(c.vmid, c.status, c.name) for c in listed] == [
        (200, "running", "ct200"),
        (205, "stopped", "idle"),
    ]
    assert listed[1].uptime_s == 0


def test_missing_vmid_names_vmid_node_and_how_to_list(config, pve_host):
    with connect(config) as (_, api, _):
        with pytest.raises(ContainerNotFound) as caught:
            proxmox.container_status(api, "pve", 4242)
    assert caught.value.message == "container 4242 does not exist on node pve"
    assert "pct list" in caught.value.hint
    assert caught.value.exit_code == EXIT_HOST


def test_unknown_node_is_a_clear_error(config, container):
    with connect(config) as (_, api, _):
        with pytest.raises(HostError, match="the Proxmox node pve2 is not known to this host"):
            proxmox.container_status(api, "pve2", 200)


def test_start_waits_for_the_task(config, make_container):
    ct = make_container(200, running=False)
    with connect(config) as connection:
        with pytest.raises(ContainerNotRunning, match="container 200 is not running") as caught:
            connection.target.run(["hostname"])
        assert "pct start 200" in caught.value.hint
        assert not proxmox.container_status(connection.proxmox, "pve", 200).running
        status = proxmox.start_container(connection.proxmox, "pve", 200)
        assert status.running
        assert ct.is_running()
        assert connection.target.run(["hostname"]).stdout_text == "ct200\n"


def test_no_container_means_no_proxmox_at_all(pve_host, write_config, tmp_path):
    config = load_config(write_config(tmp_path, vmid=None))
    before = pve_host.log_tail(10_000_000).count("pvesh")
    with connect(config) as connection:
        assert connection.proxmox is None
        assert connection.target.describe() == f"root@127.0.0.1:{pve_host.port}"
    assert pve_host.log_tail(10_000_000).count("pvesh") == before


def test_low_level_failures_inside_connect_become_host_errors(config):
    with pytest.raises(HostError) as caught:
        with connect(config):
            raise paramiko.SSHException("Channel closed.")
    assert (
        caught.value.message
        == f"talking to {config.host.user}@127.0.0.1:{config.host.port} failed: Channel closed."
    )


def test_pvesh_missing_says_this_is_not_a_proxmox_node(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no pvesh here
    api = proxmox.ssh_api(LocalTransport())
    with pytest.raises(HostError, match="pvesh is not installed on this machine"):
        proxmox.container_status(api, "pve", 200)


def test_https_token_secret_comes_from_the_environment_only(config, monkeypatch):
    config.proxmox.api = "https"
    config.proxmox.url = "https://pve.invalid:8006"
    config.proxmox.token_id = "root@pam!dflash"
    monkeypatch.delenv("PVE_TOKEN_SECRET", raising=False)
    with pytest.raises(ConfigError, match="PVE_TOKEN_SECRET .* is not set") as caught:
        proxmox.https_api(config.proxmox)
    assert caught.value.exit_code == EXIT_USAGE
    monkeypatch.setenv("PVE_TOKEN_SECRET", "s3cr3t-token-value")
    try:
        api = proxmox.https_api(config.proxmox)
    except ConfigError as exc:  # without the requests package: said plainly, no secret
        assert "requests" in exc.message
        assert "s3cr3t" not in exc.message + (exc.hint or "")
        return
    with pytest.raises(HostError) as caught:  # pve.invalid never resolves
        proxmox.container_status(api, "pve", 200)
    assert "s3cr3t" not in caught.value.message
