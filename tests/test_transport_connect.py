"""Every way connecting can fail is one plain sentence with exit code 3; host keys are
verified against known_hosts; ~/.ssh/config, ProxyJump and ProxyCommand are applied."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import paramiko
import pytest

from dflashctl.config.schema import HostConfig
from dflashctl.errors import EXIT_HOST, ConfigError
from dflashctl.remote.transport import ConnectFailed, open_transport
from dflashctl.remote.transport.ssh_config import SSH_CONFIG_ENV
from tests.ssh_support import host_config
from tests.waiting import returns


@pytest.fixture(autouse=True)
def no_agent_no_user_config(monkeypatch, tmp_path):
    """Only the keys a test names: no ssh-agent, no ~/.ssh/config of this machine."""
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.setenv(SSH_CONFIG_ENV, str(tmp_path / "no-ssh-config"))


def connect_error(config: HostConfig) -> ConnectFailed:
    transport = open_transport(config)
    try:
        with pytest.raises(ConnectFailed) as caught:
            transport.run(["true"])
    finally:
        transport.close()
    assert caught.value.exit_code == EXIT_HOST
    return caught.value


# -- the network -----------------------------------------------------------------------


def test_unresolvable_host(tmp_path):
    error = connect_error(
        HostConfig(address="no-such-host.invalid", known_hosts=str(tmp_path / "kh"))
    )
    assert error.reason == "resolve"
    assert error.message == "cannot resolve the host name no-such-host.invalid"


def test_refused_port(tmp_path):
    with socket.socket() as sock:  # a port that was free a moment ago, now closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    error = connect_error(
        HostConfig(address="127.0.0.1", port=port, known_hosts=str(tmp_path / "kh"))
    )
    assert error.reason == "refused"
    assert error.message == f"127.0.0.1 port {port} refused the connection"
    assert "sshd" in error.hint


def test_silent_listener_times_out_waiting_for_the_banner(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        # The listener never speaks: without the timeout this would wait for ever.
        error = returns(
            lambda: connect_error(
                HostConfig(
                    address="127.0.0.1",
                    port=port,
                    connect_timeout_s=0.5,
                    known_hosts=str(tmp_path / "kh"),
                )
            )
        )
    assert error.reason == "timeout"
    assert error.message == (
        f"127.0.0.1 port {port} accepted the connection but sent no SSH greeting within 0.5 s"
    )


# -- authentication ----------------------------------------------------------------------


def test_a_key_not_in_authorized_keys_fails_authentication(pve_host, tmp_path):
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    error = connect_error(host_config(pve_host, identity_file=str(stranger)))
    assert error.reason == "auth"
    assert error.message.startswith(
        f"SSH authentication failed for root@127.0.0.1:{pve_host.port}: "
        "the server accepted none of the keys tried"
    )
    assert str(stranger) in error.message
    assert "authorized_keys" in error.hint


def test_a_missing_identity_file_is_a_config_error(pve_host, tmp_path):
    transport = open_transport(host_config(pve_host, identity_file=str(tmp_path / "nokey")))
    with pytest.raises(ConfigError, match="host.identity_file: .*nokey does not exist"):
        transport.run(["true"])


def test_a_public_key_as_identity_file_is_named_as_one(pve_host, tmp_path):
    """A key pair's `.pub` half: named as a public key, with the private file to use
    instead, not paramiko's "not a valid OPENSSH private key file"."""
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    transport = open_transport(host_config(pve_host, identity_file=f"{key}.pub"))
    with pytest.raises(ConfigError) as caught:
        transport.run(["true"])
    assert caught.value.message == (
        f"host.identity_file: {key}.pub is a public key; SSH logs in with the private key"
    )
    assert caught.value.hint == f"set host.identity_file: {key} (the private key of this pair)"
    assert caught.value.exit_code == 2


# -- host keys ----------------------------------------------------------------------------


def test_unknown_host_key_is_refused_and_nothing_is_saved(pve_host, tmp_path):
    empty = pve_host.empty_known_hosts(tmp_path)
    error = connect_error(host_config(pve_host, known_hosts=str(empty)))
    assert error.reason == "host_key_unknown"
    assert error.message.startswith(
        f"the host key of [127.0.0.1]:{pve_host.port} (ssh-ed25519 SHA256:"
    )
    assert error.message.endswith(f"is not in {empty}, so the host cannot be verified")
    assert "accept_new_host_key" in error.hint
    assert empty.read_text() == ""


def test_a_missing_known_hosts_file_trusts_nothing(pve_host, tmp_path):
    error = connect_error(host_config(pve_host, known_hosts=str(tmp_path / "none" / "known_hosts")))
    assert error.reason == "host_key_unknown"
    assert not (tmp_path / "none").exists()


def test_accept_new_saves_the_key_and_then_verifies_it(pve_host, tmp_path, capfd):
    known_hosts = tmp_path / "fresh" / "known_hosts"
    with open_transport(
        host_config(pve_host, known_hosts=str(known_hosts), accept_new_host_key=True)
    ) as transport:
        assert transport.run(["echo", "hi"]).stdout == b"hi\n"
        assert transport.saved_host_keys == [f"[127.0.0.1]:{pve_host.port}"]
    assert known_hosts.read_text() == pve_host.host_key_line + "\n"
    assert known_hosts.stat().st_mode & 0o777 == 0o600
    # Announced the way OpenSSH announces it, never added silently.
    said = capfd.readouterr().err
    assert f"Warning: Permanently added '[127.0.0.1]:{pve_host.port}' (" in said
    assert "to the list of known hosts" in said and str(known_hosts) in said
    # Now known: a strict connection (and the system ssh) accept it.
    with open_transport(host_config(pve_host, known_hosts=str(known_hosts))) as transport:
        transport.run(["true"])
        assert transport.saved_host_keys == []
    ssh = subprocess.run(pve_host.ssh_argv("true", known_hosts=known_hosts), capture_output=True)
    assert ssh.returncode == 0, ssh.stderr


def test_changed_key_is_refused_with_file_line_and_fix(pve_host, tmp_path):
    wrong = pve_host.known_hosts_with_wrong_key(tmp_path)
    wrong.write_text(
        "# managed by hand\nother.example ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n"
        + wrong.read_text()
    )
    for accept_new in (False, True):  # accept-new never overrides a changed key
        error = connect_error(
            host_config(pve_host, known_hosts=str(wrong), accept_new_host_key=accept_new)
        )
        assert error.reason == "host_key_changed"
        assert f"the host key of [127.0.0.1]:{pve_host.port} has changed" in error.message
        assert f"does not match {wrong}:3;" in error.message
        assert error.hint == (
            f"if the change is expected, remove the old key with "
            f"`ssh-keygen -f {wrong} -R '[127.0.0.1]:{pve_host.port}'` and connect again"
        )
    assert wrong.read_text().count("\n") == 3


def test_changed_key_in_a_hashed_entry_is_found(pve_host, tmp_path):
    wrong = pve_host.known_hosts_with_wrong_key(tmp_path)
    name, key_type, key = wrong.read_text().split()
    hashed = paramiko.HostKeys.hash_host(name)
    wrong.write_text(f"{hashed} {key_type} {key}\n")
    error = connect_error(host_config(pve_host, known_hosts=str(wrong)))
    assert error.reason == "host_key_changed"
    assert f"{wrong}:1" in error.message


# -- ~/.ssh/config and ProxyJump -----------------------------------------------------------


def test_ssh_config_alias_supplies_hostname_port_user_and_key(pve_host, tmp_path, monkeypatch):
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(
        f"Host pve-test\n  HostName 127.0.0.1\n  Port {pve_host.port}\n  User root\n"
        f"  IdentityFile {pve_host.identity_file}\n"
    )
    monkeypatch.setenv(SSH_CONFIG_ENV, str(ssh_config))
    config = HostConfig(
        address="pve-test", port=None, user=None, known_hosts=str(pve_host.known_hosts)
    )
    with open_transport(config) as transport:
        assert transport.description == f"root@127.0.0.1:{pve_host.port}"
        assert transport.run(["echo", "via alias"]).stdout_text == "via alias\n"


def test_explicit_values_win_over_ssh_config(pve_host, tmp_path, monkeypatch):
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text("Host 127.0.0.1\n  Port 1\n  User nobody\n")
    monkeypatch.setenv(SSH_CONFIG_ENV, str(ssh_config))
    with open_transport(host_config(pve_host)) as transport:
        assert transport.description == f"root@127.0.0.1:{pve_host.port}"
        transport.run(["true"])


def test_proxy_jump_goes_through_a_verified_first_connection(pve_host, tmp_path, monkeypatch):
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(f"Host *\n  IdentityFile {pve_host.identity_file}\n")
    monkeypatch.setenv(SSH_CONFIG_ENV, str(ssh_config))
    before = pve_host.log_tail(10_000_000).count("Accepted publickey for root")
    jump = f"root@127.0.0.1:{pve_host.port}"
    with open_transport(host_config(pve_host, proxy_jump=jump)) as transport:
        assert transport.run(["echo", "jumped"]).stdout_text == "jumped\n"
    log = pve_host.log_tail(10_000_000)
    assert log.count("Accepted publickey for root") == before + 2
    # The jump host's key is checked like any other.
    empty = pve_host.empty_known_hosts(tmp_path)
    error = connect_error(host_config(pve_host, proxy_jump=jump, known_hosts=str(empty)))
    assert error.reason == "host_key_unknown"


def test_proxy_jump_to_a_closed_port_names_the_jump_host(pve_host, tmp_path, monkeypatch):
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(f"Host *\n  IdentityFile {pve_host.identity_file}\n")
    monkeypatch.setenv(SSH_CONFIG_ENV, str(ssh_config))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    error = connect_error(
        host_config(pve_host, port=closed, proxy_jump=f"root@127.0.0.1:{pve_host.port}")
    )
    assert error.reason == "jump"
    assert error.message.startswith(
        f"the jump host root@127.0.0.1:{pve_host.port} could not connect to 127.0.0.1 port {closed}"
    )


def _proxy_config(pve_host, tmp_path, command: str) -> Path:
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(
        f"Host gpu-box\n  HostName 127.0.0.1\n  Port {pve_host.port}\n  User root\n"
        f"  IdentityFile {pve_host.identity_file}\n  ProxyCommand {command}\n"
    )
    return ssh_config


def test_proxy_command_carries_a_verified_connection(pve_host, tmp_path, monkeypatch):
    log = tmp_path / "proxy.log"
    pipe = Path(__file__).parent / "tcp_pipe.py"
    command = f"{sys.executable} {pipe} %h %p {log}"
    monkeypatch.setenv(SSH_CONFIG_ENV, str(_proxy_config(pve_host, tmp_path, command)))
    config = HostConfig(
        address="gpu-box", port=None, user=None, known_hosts=str(pve_host.known_hosts)
    )
    with open_transport(config) as transport:
        assert transport.run(["echo", "through the proxy"]).stdout_text == "through the proxy\n"
    assert log.read_text() == f"127.0.0.1 {pve_host.port}\n"  # ran once, tokens expanded
    # The host key is checked through a proxy like on a direct connection.
    empty = pve_host.empty_known_hosts(tmp_path)
    unknown = HostConfig(address="gpu-box", port=None, user=None, known_hosts=str(empty))
    assert connect_error(unknown).reason == "host_key_unknown"


def test_a_failing_proxy_command_says_so_with_its_own_words(pve_host, tmp_path, monkeypatch):
    # ssh runs `exec <command>` in a shell, and so do we: a failing program, not a script.
    command = f"{sys.executable} -c \"import sys; sys.exit('bastion: no route to gpu-box')\""
    monkeypatch.setenv(SSH_CONFIG_ENV, str(_proxy_config(pve_host, tmp_path, command)))
    error = connect_error(
        HostConfig(address="gpu-box", port=None, user=None, known_hosts=str(pve_host.known_hosts))
    )
    assert error.reason == "proxy"
    assert error.message == (
        "the ProxyCommand for gpu-box exited with status 1 before SSH could start: "
        "bastion: no route to gpu-box"
    )
    assert command in error.hint


def test_resolve_proxy_command_precedence(tmp_path, monkeypatch):
    from dflashctl.remote.transport.ssh_config import resolve

    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(
        "Host both\n  ProxyJump bastion\n  ProxyCommand nc %h %p\n"
        "Host cmd\n  HostName 10.0.0.7\n  ProxyCommand ssh -W %h:%p bastion\n"
        "Host off\n  ProxyCommand none\n"
    )
    monkeypatch.setenv(SSH_CONFIG_ENV, str(ssh_config))
    assert resolve("cmd").proxy_command == "ssh -W 10.0.0.7:22 bastion"
    both = resolve("both")
    assert (both.proxy_jump, both.proxy_command) == ("bastion", None)
    assert resolve("cmd", proxy_jump="me@jump").proxy_command is None  # dflash.yaml wins
    assert resolve("off").proxy_command is None


def test_resolve_defaults_and_precedence(tmp_path, monkeypatch):
    from dflashctl.remote.transport.ssh_config import resolve, resolve_jumps

    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(
        "Host gpu\n  HostName 10.0.0.5\n  Port 2200\n  User admin\n  ProxyJump bastion\n"
        "Host bastion\n  HostName 10.0.0.1\n  User jump\n"
    )
    monkeypatch.setenv(SSH_CONFIG_ENV, str(ssh_config))
    from_config = resolve("gpu")
    assert (from_config.hostname, from_config.port, from_config.user) == ("10.0.0.5", 2200, "admin")
    assert from_config.proxy_jump == "bastion"
    assert from_config.known_hosts_name == "[10.0.0.5]:2200"
    explicit = resolve("gpu", port=22, user="root", proxy_jump="other:2022")
    assert (explicit.port, explicit.user, explicit.proxy_jump) == (22, "root", "other:2022")
    assert explicit.known_hosts_name == "10.0.0.5"
    plain = resolve("pve.lan")
    assert (plain.hostname, plain.port, plain.user) == ("pve.lan", 22, "root")
    hops = resolve_jumps("bastion,me@[::1]:2022")
    assert [(h.hostname, h.port, h.user) for h in hops] == [
        ("10.0.0.1", 22, "jump"),
        ("::1", 2022, "me"),
    ]


def test_ssh_agent_keys_are_used(pve_host, tmp_path, monkeypatch):
    import os
    import re
    import signal

    sock = tmp_path / "agent.sock"
    started = subprocess.run(
        ["ssh-agent", "-s", "-a", str(sock)], capture_output=True, text=True, check=True
    )
    agent_pid = int(re.search(r"SSH_AGENT_PID=(\d+)", started.stdout).group(1))
    try:
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        subprocess.run(
            ["ssh-add", "-q", str(pve_host.identity_file)], check=True, capture_output=True
        )
        with open_transport(host_config(pve_host, identity_file=None)) as transport:
            assert transport.run(["echo", "agent"]).stdout == b"agent\n"
    finally:
        os.kill(agent_pid, signal.SIGTERM)
