"""The agent's cache folder in the shared /tmp is a trust boundary: a folder, a link
or a file another user planted there never makes root run their code or write
through their links."""

from __future__ import annotations

import json
import marshal
import os
import stat
import subprocess
import sys

import pytest

from dflashctl.remote import agent_client

OTHER_UID = 65534  # nobody

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to play another user")


def _call(op, params, *, with_bundle, env):
    done = subprocess.run(
        agent_client.agent_argv(sys.executable, op),
        input=agent_client.agent_input(op, params, with_bundle=with_bundle),
        capture_output=True,
        env=env,
        timeout=60,
    )
    return done.returncode, json.loads(done.stdout.decode().strip().splitlines()[-1])


def _setup(tmp_path):
    shared = tmp_path / "tmp"
    shared.mkdir(mode=0o1777)
    os.chmod(shared, 0o1777)
    env = dict(os.environ, TMPDIR=str(shared))
    return shared, shared / f"dflashctl-agent-{os.getuid()}", env


def _assert_private(folder):
    info = os.lstat(folder)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
    assert info.st_mode & 0o077 == 0


def test_a_folder_another_user_made_beforehand_is_moved_aside(tmp_path):
    shared, folder, env = _setup(tmp_path)
    folder.mkdir()
    os.chmod(folder, 0o777)
    os.chown(folder, OTHER_UID, OTHER_UID)
    status, answer = _call("runs", {"workdir": str(tmp_path / "w")}, with_bundle=True, env=env)
    assert (status, answer["ok"]) == (0, True)
    _assert_private(folder)
    assert (folder / f"{agent_client.bundle_hash()}.py").is_file()
    # The other user's folder got nothing of ours.
    (aside,) = [p for p in shared.iterdir() if p.name.startswith(folder.name + ".unsafe-")]
    assert os.lstat(aside).st_uid == OTHER_UID and list(aside.iterdir()) == []


def test_a_folder_open_to_others_is_not_used_even_when_it_is_ours(tmp_path):
    shared, folder, env = _setup(tmp_path)
    folder.mkdir()
    os.chmod(folder, 0o777)
    # A planted copy with the right name is never read from an open folder.
    status, answer = _call("runs", {"workdir": str(tmp_path / "w")}, with_bundle=True, env=env)
    assert (status, answer["ok"]) == (0, True)
    _assert_private(folder)


def test_a_link_in_place_of_the_folder_is_not_followed(tmp_path):
    shared, folder, env = _setup(tmp_path)
    victim = tmp_path / "root-only"
    victim.mkdir(mode=0o700)
    (victim / "secret").write_text("keep me")
    folder.symlink_to(victim)
    status, answer = _call("runs", {"workdir": str(tmp_path / "w")}, with_bundle=True, env=env)
    assert (status, answer["ok"]) == (0, True)
    assert sorted(p.name for p in victim.iterdir()) == ["secret"]
    assert (victim / "secret").read_text() == "keep me"
    _assert_private(folder)


def test_a_swapped_code_cache_never_runs(tmp_path):
    shared, folder, env = _setup(tmp_path)
    params = {"workdir": str(tmp_path / "w")}
    _call("runs", params, with_bundle=True, env=env)
    _call("runs", params, with_bundle=False, env=env)
    code = folder / f"{agent_client.bundle_hash()}.{sys.implementation.cache_tag}.code"
    assert code.is_file()
    mark = tmp_path / "pwned"
    payload = compile(f"open({str(mark)!r}, 'w').write('ran')", "evil", "exec")
    evil = {name: payload for name in agent_client.agent_modules()}
    # As a marshal file of its own, and behind a digest that is not its own.
    for swapped in (marshal.dumps(evil), b"\0" * 32 + marshal.dumps(evil)):
        code.write_bytes(swapped)
        done = subprocess.run(
            agent_client.agent_argv(sys.executable, "runs"),
            input=agent_client.agent_input("runs", params, with_bundle=False),
            capture_output=True,
            env=env,
            timeout=60,
        )
        assert not mark.exists(), "the swapped cache ran"
        assert done.returncode == 0 and b'"ok": true' in done.stdout, done.stderr


def test_a_cache_file_another_user_can_write_is_not_loaded(tmp_path):
    shared, folder, env = _setup(tmp_path)
    params = {"workdir": str(tmp_path / "w")}
    _call("runs", params, with_bundle=True, env=env)
    _call("runs", params, with_bundle=False, env=env)
    code = folder / f"{agent_client.bundle_hash()}.{sys.implementation.cache_tag}.code"
    os.chmod(code, 0o666)
    before = code.stat().st_ino
    status, answer = _call("runs", params, with_bundle=False, env=env)
    assert (status, answer["ok"]) == (0, True)
    # Not trusted, so compiled afresh and written again as a new private file.
    assert code.stat().st_ino != before and code.stat().st_mode & 0o077 == 0
