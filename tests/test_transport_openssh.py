# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""A deploy's archive through the system's OpenSSH (dflashctl/remote/transport/openssh.py),
against the test host's real sshd: the master it keeps, the same strict host keys,
paramiko as the fallback, and a transfer cut mid-way."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashctl.remote.transport import openssh
from dflashctl.remote.transport.remote import RemoteTransport
from tests.json_answers import flat
from tests.ssh_support import host_config
from tests.test_deploy_container import ct_pid_alive
from tests.test_deploy_support import write_trainer

pytestmark = pytest.mark.slow

WORKDIR = "/root/dflash"
DFLASHCTL = [sys.executable, "-m", "dflashctl"]


@pytest.fixture
def setup(tmp_path, container, write_config, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = write_trainer(tmp_path / "src")
    path = write_config(
        tmp_path,
        trainer_source=source,
        **{"trainer.entry": "train.py", "trainer.args": ["--sleep", "60"], "run.stop_grace_s": 3},
    )
    return path, source, container


def cli(path: Path, *extra: str, env: dict | None = None, python_flags=()) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *python_flags, "-m", "dflashctl", "deploy", "-c", str(path)]
        + ["--detach", "--yes", "--json", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )


def finished(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=120)
    return process.returncode, out, err


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_big_file_goes_through_the_master_and_a_redeploy_needs_no_paramiko(setup, pve_host):
    path, source, container = setup
    (source / "weights.bin").write_bytes(os.urandom(24 << 20))
    code, out, err = finished(cli(path))
    assert code == 0, err
    first = flat(json.loads(out))
    release = container.host_path(f"{WORKDIR}/releases/{first['release']}")
    assert sha256(release / "weights.bin") == sha256(source / "weights.bin")
    # The master the deploy started is up, for the next command to reuse.
    runner = openssh.connect(
        host_config(pve_host), RemoteTransport(host_config(pve_host)).destination
    )
    assert runner is not None and runner.master_running()
    assert oct(os.stat(Path(runner.control_path).parent).st_mode & 0o777) == "0o700"

    # A one-file redeploy: its one remote call goes over that master, without paramiko.
    (source / "helpers.py").write_text("def greeting():\n    return 'again'\n")
    code, out, err = finished(cli(path, python_flags=["-X", "importtime"]))
    assert code == 0, err
    again = flat(json.loads(out))
    assert again["files_sent"] == 1 and again["previous_release"] == first["release"]
    assert "paramiko" not in err
    new = container.host_path(f"{WORKDIR}/releases/{again['release']}")
    assert (new / "helpers.py").read_text().endswith("'again'\n")
    assert os.stat(new / "weights.bin").st_ino == os.stat(release / "weights.bin").st_ino


def test_paramiko_carries_the_archive_when_told_to(setup):
    path, source, container = setup
    (source / "weights.bin").write_bytes(os.urandom(8 << 20))
    code, out, err = finished(cli(path, env={openssh.CLIENT_ENV: "paramiko"}))
    assert code == 0, err
    release = container.host_path(f"{WORKDIR}/releases/{flat(json.loads(out))['release']}")
    assert sha256(release / "weights.bin") == sha256(source / "weights.bin")


def test_a_changed_host_key_is_refused_by_the_system_ssh_and_nothing_is_sent(
    setup, pve_host, tmp_path
):
    wrong = pve_host.known_hosts_with_wrong_key(tmp_path / "keys")
    host = host_config(pve_host, known_hosts=str(wrong))
    # ssh itself refuses it (StrictHostKeyChecking=yes, only this known_hosts): no master.
    runner = openssh.OpenSSH(
        host, RemoteTransport(host).destination, "ssh", openssh.control_folder()
    )
    problem = runner.start_master()
    assert problem and "Host key verification failed" in problem
    assert not runner.master_running()
    assert openssh.connect(host, RemoteTransport(host).destination) is None

    path, source, container = setup
    config = path.read_text().replace(str(pve_host.known_hosts), str(wrong))
    path.write_text(config)
    code, out, err = finished(cli(path))
    assert code == 3, err
    assert "has changed" in err and "Traceback" not in err
    assert not container.host_path(f"{WORKDIR}/releases").exists()


def ssh_children(pid: int) -> list[int]:
    """The `ssh` processes the dflashctl process `pid` started."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            try:
                if Path(f"/proc/{child}/comm").read_text().strip() == "ssh":
                    found.append(child)
            except OSError:
                pass
    return found


def test_killing_ssh_mid_transfer_leaves_no_partial_release_and_the_old_run_running(setup):
    path, source, container = setup
    code, out, err = finished(cli(path))
    assert code == 0, err
    first = flat(json.loads(out))
    (source / "weights.bin").write_bytes(os.urandom(64 << 20))
    releases = container.host_path(f"{WORKDIR}/releases")
    process = cli(path)
    killed = []
    deadline = time.monotonic() + 60
    while not killed and process.poll() is None and time.monotonic() < deadline:
        for partial in releases.glob("*.partial"):
            try:
                if (partial / "weights.bin").stat().st_size > 4 << 20:
                    for pid in ssh_children(process.pid):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
            except FileNotFoundError:
                pass
        time.sleep(0.002)
    code, out, err = finished(process)
    assert killed, "the transfer ended before it could be cut"
    assert code == 3 and "Traceback" not in err, err
    assert "dropped while running" in err and "dflashctl runs" in err
    workdir = container.host_path(WORKDIR)
    assert os.readlink(workdir / "current") == f"releases/{first['release']}"
    assert ct_pid_alive(container, first["pid"])
    # The agent saw its archive end early: it removes what it had unpacked.
    deadline = time.monotonic() + 60  # a net: the loop ends as soon as the folder is gone
    while list(releases.glob("*.partial")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(releases.glob("*.partial"))
    assert [p.name for p in releases.iterdir() if p.is_dir()] == [first["release"]]


def test_a_known_hosts_path_with_spaces_and_percent_signs_is_used_as_is(pve_host, tmp_path):
    folder = tmp_path / "my keys 100%"
    folder.mkdir()
    known = folder / "known hosts"
    known.write_text(Path(pve_host.known_hosts).read_text())
    host = host_config(pve_host, known_hosts=str(known))
    runner = openssh.connect(host, RemoteTransport(host).destination)
    assert runner is not None and runner.master_running()
    result = runner.run(["sh", "-c", "wc -c"], stdin=b"x" * 100_000, timeout=30)
    assert result.exit_status == 0 and result.stdout.split() == [b"100000"]


def test_an_alias_of_the_ssh_config_is_resolved_by_ssh_itself(pve_host, tmp_path, monkeypatch):
    config = tmp_path / "ssh_config"
    config.write_text(
        "Host testnode\n"
        f"    HostName {pve_host.address}\n"
        f"    Port {pve_host.port}\n"
        f"    User {pve_host.user}\n"
        f"    IdentityFile {pve_host.identity_file}\n"
    )
    monkeypatch.setenv("DFLASHCTL_SSH_CONFIG", str(config))
    host = host_config(pve_host, address="testnode", port=None, user=None, identity_file=None)
    runner = openssh.connect(host, RemoteTransport(host).destination)
    assert runner is not None, "ssh could not connect through the alias"
    result = runner.run(["sh", "-c", "echo $USER"], stdin=b"", timeout=30)
    assert result.exit_status == 0 and result.stdout.strip() == pve_host.user.encode()
