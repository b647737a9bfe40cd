"""Helpers shared by the SSH transport tests (no tests here)."""

from __future__ import annotations

from dflashctl.config.schema import HostConfig


def host_config(pve_host, **overrides) -> HostConfig:
    """A HostConfig for the test host's sshd, with any field overridden."""
    values = dict(
        address=pve_host.address,
        port=pve_host.port,
        user=pve_host.user,
        identity_file=str(pve_host.identity_file),
        known_hosts=str(pve_host.known_hosts),
        connect_timeout_s=10,
        keepalive_s=15,
    )
    values.update(overrides)
    return HostConfig(**values)
