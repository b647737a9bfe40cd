"""Host key rules on known_hosts files written here (no server): hashed and plain
entries found, a changed key named by its line with the command that removes it, an
unknown key refused with the fingerprint to check, and trust on first use saved 0600."""

from __future__ import annotations

import base64
import hashlib
import stat

import paramiko
import pytest

from dflashctl.remote.transport.base import ConnectFailed
from dflashctl.remote.transport.host_keys import (
    VerifyingPolicy,
    append_known_host,
    changed_key_error,
    fingerprint,
    key_type,
    lines_for,
    load_known_hosts,
    unknown_key_error,
)


@pytest.fixture(scope="module")
def keys():
    return paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()


def test_fingerprint_and_type_as_openssh_prints_them(keys):
    key = keys[0]
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    assert fingerprint(key) == f"SHA256:{digest}"
    assert key_type(key) == "ECDSA"


def test_hashed_and_plain_entries_are_found_by_name(tmp_path, keys):
    path = tmp_path / "known_hosts"
    hashed = paramiko.HostKeys.hash_host("[10.0.0.5]:2222")
    path.write_text(
        "# a comment naming gpu-a\n"
        f"gpu-a,gpu-a.lan {keys[0].get_name()} {keys[0].get_base64()}\n"
        f"@revoked gpu-a {keys[1].get_name()} {keys[1].get_base64()}\n"
        f"{hashed} {keys[1].get_name()} {keys[1].get_base64()}\n"
    )
    assert lines_for(path, "gpu-a") == [(2, keys[0].get_name())]
    assert lines_for(path, "[10.0.0.5]:2222") == [(4, keys[1].get_name())]
    assert lines_for(path, "gpu-b") == []
    assert lines_for(tmp_path / "missing", "gpu-a") == []
    assert load_known_hosts(path).lookup("gpu-a") is not None
    assert len(load_known_hosts(tmp_path / "missing").keys()) == 0


def test_a_changed_key_names_the_line_and_how_to_remove_it(tmp_path, keys):
    path = tmp_path / "known_hosts"
    path.write_text(f"gpu-a {keys[0].get_name()} {keys[0].get_base64()}\n")
    error = changed_key_error(path, "gpu-a", keys[1])
    assert error.reason == "host_key_changed"
    assert f"{path}:1" in str(error) and fingerprint(keys[1]) in str(error)
    assert f"ssh-keygen -f {path} -R gpu-a" in error.hint


def test_an_unknown_key_says_which_ssh_command_checks_it(tmp_path, keys):
    error = unknown_key_error(tmp_path / "kh", "[127.0.0.1]:2222", "root", keys[0])
    assert error.reason == "host_key_unknown" and fingerprint(keys[0]) in str(error)
    assert f"ssh -p 2222 -o UserKnownHostsFile={tmp_path / 'kh'} root@127.0.0.1 true" in error.hint


def test_the_policy_refuses_unless_told_to_save_and_then_saves_0600(tmp_path, keys, capsys):
    path = tmp_path / "ssh" / "known_hosts"
    client = paramiko.SSHClient()
    with pytest.raises(ConnectFailed, match="is not in"):
        VerifyingPolicy(path, "root", accept_new=False).missing_host_key(client, "gpu-a", keys[0])
    assert not path.exists()
    policy = VerifyingPolicy(path, "root", accept_new=True)
    policy.missing_host_key(client, "gpu-a", keys[0])
    assert policy.saved == ["gpu-a"] and client.get_host_keys().lookup("gpu-a") is not None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert "Permanently added 'gpu-a' (ECDSA)" in capsys.readouterr().err
    path.write_text(path.read_text().rstrip("\n"))  # a file without its last newline
    append_known_host(path, "gpu-b", keys[1])
    assert [n for n, _ in lines_for(path, "gpu-b")] == [2]


def test_marker_and_damaged_lines_are_skipped_not_a_traceback(tmp_path, keys):
    path = tmp_path / "known_hosts"
    path.write_text(
        f"@cert-authority *.lan {keys[1].get_name()} {keys[1].get_base64()}\n"
        f"@revoked gpu-a {keys[1].get_name()} {keys[1].get_base64()}\n"
        "gpu-c ssh-ed25519 not-base64!\n"
        f"gpu-a {keys[0].get_name()} {keys[0].get_base64()}\n"
    )
    known = load_known_hosts(path)
    assert known.lookup("gpu-a")[keys[0].get_name()] == keys[0]
    assert known.lookup("gpu-c") is None and known.lookup("x.lan") is None
