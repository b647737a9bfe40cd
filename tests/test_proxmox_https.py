"""The Proxmox API over HTTPS with an API token, against the HTTPS stand-in of the test
host (tests/host/https_api.py): status, start with its task, permission errors, and the
self-signed certificate checked by a CA bundle or a pinned fingerprint."""

from __future__ import annotations

import pytest

from dflashctl.config.schema import load_config
from dflashctl.errors import EXIT_HOST, EXIT_USAGE, ConfigError, HostError, Notice
from dflashctl.remote import proxmox
from dflashctl.remote.pct import ContainerNotFound
from dflashctl.remote.proxmox_tls import colon_fingerprint, parse_verify_tls
from tests.host.fixtures import TOKEN_ID, TOKEN_SECRET


@pytest.fixture
def https_config(pve_https, write_config, tmp_path, monkeypatch):
    """A config with api: https, the stand-in's URL and token, its certificate pinned."""
    monkeypatch.setenv("PVE_TOKEN_SECRET", TOKEN_SECRET)
    config = load_config(write_config(tmp_path))
    config.proxmox.api, config.proxmox.url = "https", pve_https.url
    config.proxmox.token_id = TOKEN_ID
    config.proxmox.verify_tls = f"sha256:{pve_https.fingerprint}"
    return config


def api_for(config):
    return proxmox.https_api(config.proxmox)


def test_status_over_https_with_the_token_and_a_pinned_certificate(
    https_config, pve_https, container, caplog
):
    caplog.set_level("DEBUG")
    status = proxmox.container_status(api_for(https_config), "pve", 200)
    assert (status.vmid, status.status, status.name) == (200, "running", "ct200")
    assert proxmox.api_version(api_for(https_config)) == "8.2.4"
    method, path, token = pve_https.requests[-1]
    assert (method, path, token) == ("GET", "/api2/json/version", TOKEN_ID)
    assert ("GET", "/api2/json/nodes/pve/lxc/200/status/current", TOKEN_ID) in pve_https.requests
    assert not any(TOKEN_SECRET in record.getMessage() for record in caplog.records)


def test_start_over_https_waits_for_the_task_and_pct_sees_it_running(
    https_config, pve_https, make_container
):
    ct = make_container(200, running=False)
    status = proxmox.start_container(api_for(https_config), "pve", 200, timeout=60)
    assert status.running and status.warnings is None
    assert ct.exec(["hostname"]).stdout.strip() == "ct200"  # the same state as pct
    paths = [path for method, path, _ in pve_https.requests if method == "POST"]
    assert paths == ["/api2/json/nodes/pve/lxc/200/status/start"]
    task_polls = [p for _, p, _ in pve_https.requests if "/tasks/UPID:pve:" in p]
    assert task_polls and all(p.endswith("/status") for p in task_polls)


def test_a_start_whose_task_fails_names_the_task_error(https_config, make_container):
    ct = make_container(201, running=False)
    ct.configure(start_error="startup for container '201' failed", start_delay_s=0.3)
    with pytest.raises(HostError) as caught:
        proxmox.start_container(api_for(https_config), "pve", 201, timeout=60)
    assert caught.value.message == (
        "starting container 201 failed: startup for container '201' failed"
    )
    assert "pct start 201" in caught.value.hint


def test_a_start_with_warnings_is_a_success(https_config, make_container):
    ct = make_container(202, running=False)
    ct.configure(start_warnings=["hook said so"])
    status = proxmox.start_container(api_for(https_config), "pve", 202, timeout=60)
    assert status.running and status.warnings.startswith("WARNINGS: 1")


def test_unknown_container_over_https(https_config, pve_https):
    with pytest.raises(ContainerNotFound, match="container 4242 does not exist on node pve"):
        proxmox.container_status(api_for(https_config), "pve", 4242)


def test_a_wrong_secret_is_401_and_the_secret_is_never_shown(
    https_config, pve_https, container, monkeypatch
):
    monkeypatch.setenv("PVE_TOKEN_SECRET", "not-the-secret")
    with pytest.raises(HostError) as caught:
        proxmox.container_status(api_for(https_config), "pve", 200)
    assert caught.value.message == (
        "the Proxmox API refused the API token (401 authentication failure)"
    )
    assert caught.value.exit_code == EXIT_HOST
    assert "not-the-secret" not in caught.value.message + caught.value.hint


def test_a_token_without_the_privilege_is_403_naming_path_and_privilege(
    https_config, pve_https, make_container
):
    make_container(203, running=False)
    pve_https.add_token("auditor@pve", "ro", "ro-secret", privileges={"VM.Audit"})
    https_config.proxmox.token_id = "auditor@pve!ro"
    import os

    os.environ["PVE_TOKEN_SECRET"] = "ro-secret"
    try:
        api = api_for(https_config)
        assert proxmox.container_status(api, "pve", 203).status == "stopped"
        with pytest.raises(HostError) as caught:
            proxmox.start_container(api, "pve", 203, timeout=30)
    finally:
        os.environ["PVE_TOKEN_SECRET"] = TOKEN_SECRET
    assert caught.value.message == (
        "the Proxmox API token lacks a privilege: Permission check failed (/vms/203, VM.PowerMgmt)"
    )
    assert "pveum acl modify" in caught.value.hint


def test_the_self_signed_certificate_is_refused_by_default(https_config, container):
    https_config.proxmox.verify_tls = True
    with pytest.raises(HostError, match="its TLS certificate is not trusted") as caught:
        proxmox.container_status(api_for(https_config), "pve", 200)
    assert "pvenode cert info" in caught.value.hint


def test_a_ca_bundle_trusts_it(https_config, pve_https, container):
    https_config.proxmox.verify_tls = str(pve_https.certificate)
    assert proxmox.container_status(api_for(https_config), "pve", 200).running


def test_verification_off_still_works(https_config, container):
    https_config.proxmox.verify_tls = False
    # ... but never silently: the token goes to whoever answers.
    with pytest.warns(Notice, match="verify_tls is false: the API token .* without checking"):
        api = api_for(https_config)
        assert proxmox.container_status(api, "pve", 200).running


def test_a_notice_is_said_as_a_warning_line_by_the_cli():
    import subprocess
    import sys

    program = (
        "import warnings\n"
        "from dflashctl import cli\n"
        "from dflashctl.errors import Notice\n"
        "cli._say_notices()\n"
        "warnings.warn(Notice('the token goes unchecked'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert done.stderr.strip() == "! the token goes unchecked"


def test_a_changed_certificate_is_refused_like_a_changed_host_key(
    https_config, pve_https, container
):
    other = "sha256:" + ":".join(["AB"] * 32)
    https_config.proxmox.verify_tls = other
    with pytest.raises(HostError) as caught:
        proxmox.container_status(api_for(https_config), "pve", 200)
    message = caught.value.message
    assert message.startswith(f"the TLS certificate of {pve_https.url} has changed")
    assert f"the server presents sha256:{pve_https.fingerprint}" in message
    assert other in message and "refusing to connect" in message
    assert "pvenode cert info" in caught.value.hint
    assert caught.value.exit_code == EXIT_HOST
    # Nothing reached the API: the token was not sent to the wrong server.
    before = len(pve_https.requests)
    with pytest.raises(HostError):
        proxmox.api_version(api_for(https_config))
    assert len(pve_https.requests) == before


def test_a_fingerprint_written_in_lowercase_or_without_colons_also_pins(
    https_config, pve_https, container
):
    https_config.proxmox.verify_tls = f"sha256:{pve_https.fingerprint.lower()}"
    assert proxmox.container_status(api_for(https_config), "pve", 200).running
    https_config.proxmox.verify_tls = "sha256:" + pve_https.fingerprint.replace(":", "")
    assert proxmox.container_status(api_for(https_config), "pve", 200).running


def test_verify_tls_values_are_checked_when_the_config_loads(write_config, tmp_path):
    bad = write_config(tmp_path, proxmox={"verify_tls": "sha256:12:34"})
    with pytest.raises(ConfigError, match="not a SHA-256 fingerprint") as caught:
        load_config(bad)
    assert caught.value.exit_code == EXIT_USAGE
    missing = write_config(tmp_path, proxmox={"verify_tls": str(tmp_path / "no-ca.pem")})
    with pytest.raises(ConfigError, match="neither true/false, a CA bundle"):
        load_config(missing)


def test_fingerprint_forms():
    digest = "ab" * 32
    assert parse_verify_tls(f"sha256:{digest}").fingerprint == digest
    assert colon_fingerprint(digest) == "sha256:" + ":".join(["AB"] * 32)
    assert parse_verify_tls(True).kind == "ca" and parse_verify_tls(False).kind == "off"
