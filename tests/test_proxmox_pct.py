"""pct argv and error parsing, and Target (container or host) against the test host."""

from __future__ import annotations

import pytest

from dflashctl.config.schema import HostConfig
from dflashctl.remote import pct
from dflashctl.remote.deploy_target import Target
from dflashctl.remote.transport import CommandFailed, LocalTransport, open_transport
from dflashctl.remote.transport.base import CommandResult

# -- argv and parsing (no host) ----------------------------------------------------------


def test_argv_builders():
    # With a root login's environment instead of the SSH session's, plus the given env.
    argv = pct.exec_argv(200, ["python3", "-V"], {"A": "1"})
    assert argv[:6] == ["pct", "exec", "200", "--", "env", "-i"]
    assert f"PATH={pct.LOGIN_PATH}" in argv and "/usr/local/bin" in pct.LOGIN_PATH
    assert argv[-4:] == ["env", "A=1", "python3", "-V"]


def failed(argv, stderr: str, status: int = 255) -> CommandResult:
    return CommandResult(argv, status, b"", stderr.encode())


def test_missing_config_means_no_such_container():
    error = pct.container_error(
        failed(
            pct.exec_argv(999, ["true"]),
            "Configuration file 'nodes/pve/lxc/999.conf' does not exist\n",
            2,
        ),
        999,
    )
    assert isinstance(error, pct.ContainerNotFound)
    assert error.message == "container 999 does not exist on node pve"
    assert "pct list" in error.hint


def test_exec_separates_pct_failures_from_the_commands_own_status():
    lxc = (
        "lxc-attach: 200: ../src/lxc/attach.c: get_attach_context: 405 Connection refused - "
        "Failed to get init pid\n"
    )
    error = pct.container_error(failed(pct.exec_argv(200, ["true"]), lxc, 1), 200)
    assert isinstance(error, pct.ContainerNotRunning)
    assert (
        error.hint == "start it with `pct start 200` on the host, or deploy with --start-container"
    )
    own = failed(pct.exec_argv(200, ["grep", "x"]), "grep: not running anything\n", 1)
    assert pct.container_error(own, 200) is None


# -- Target on the test host --------------------------------------------------------------


def host_config(pve_host) -> HostConfig:
    return HostConfig(
        address=pve_host.address,
        port=pve_host.port,
        user=pve_host.user,
        identity_file=str(pve_host.identity_file),
        known_hosts=str(pve_host.known_hosts),
    )


@pytest.fixture
def transport(pve_host):
    with open_transport(host_config(pve_host)) as transport:
        yield transport


def test_describe(transport, pve_host):
    assert Target(transport, 200).describe() == f"CT 200 on root@127.0.0.1:{pve_host.port}"
    assert Target(transport, None).describe() == f"root@127.0.0.1:{pve_host.port}"
    assert Target(LocalTransport(), None).describe() == "this machine"


def test_run_in_the_container_with_env_and_status(transport, container):
    target = Target(transport, 200)
    assert target.run(["hostname"]).stdout_text == "ct200\n"
    assert target.run(["sh", "-c", 'echo "$A"'], env={"A": "1 2"}).stdout_text == "1 2\n"
    result = target.run(["sh", "-c", "exit 7"], check=False)
    assert (result.exit_status, result.argv) == (7, ["sh", "-c", "exit 7"])
    with pytest.raises(CommandFailed, match=r"`false` failed on CT 200 on root@127\.0\.0\.1"):
        target.run(["false"])


def test_stopped_container_is_a_clear_error_everywhere(transport, make_container):
    make_container(201, running=False)
    target = Target(transport, 201)
    with pytest.raises(pct.ContainerNotRunning, match="container 201 is not running") as caught:
        target.run(["true"], check=False)
    assert "pct start 201" in caught.value.hint
    stream = target.stream(["echo", "hi"])
    with pytest.raises(pct.ContainerNotRunning):
        while stream.read(10) != b"":
            pass
    stream.close()


def test_missing_vmid_is_a_clear_error(transport, pve_host):
    with pytest.raises(pct.ContainerNotFound, match="container 4242 does not exist on node pve"):
        Target(transport, 4242).run(["true"])


def test_stream_in_the_container(transport, container):
    with Target(transport, 200).stream(["sh", "-c", "echo one; echo two; exit 3"]) as stream:
        data = b""
        while (chunk := stream.read(10)) != b"":
            data += chunk or b""
        assert data == b"one\ntwo\n"
        assert stream.exit_status == 3


def test_target_on_the_host_itself(transport, tmp_path):
    target = Target(transport, None)
    target.run(["sh", "-c", f"printf direct > {tmp_path / 'f'}"])
    assert (tmp_path / "f").read_bytes() == b"direct"
    assert target.run(["cat", str(tmp_path / "f")]).stdout == b"direct"
