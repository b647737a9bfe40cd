# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""What the real pct and pvesh do (../shared/notes/proxmox-and-ssh.md, the table at the
end), met by dflashctl: a stopped container's text, a big archive past a small /tmp,
pct exec's environment, WARNINGS, HA starts, slow starts, a failing /version.

Against the test host, whose stand-ins follow that table on real LXC containers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from dflashctl.config.schema import load_config
from dflashctl.errors import HostError
from dflashctl.remote import pct, proxmox
from dflashctl.remote.connect import connect
from dflashctl.remote.transport.base import CommandResult
from tests.json_answers import flat
from tests.test_deploy_support import write_trainer

DFLASHCTL = [sys.executable, "-m", "dflashctl"]
WORKDIR = "/root/dflash"


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*DFLASHCTL, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@contextmanager
def small_tmp(container, size: str = "64k"):
    """The container's /tmp on a tmpfs of `size` (mounted while it is stopped, so that
    its start binds it in); the container runs inside the block."""
    if container.is_running():
        container.stop()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(container.tmp)])
    try:
        container.start()
        yield
    finally:
        container.stop()
        subprocess.run(["umount", "-l", str(container.tmp)], check=True)


@contextmanager
def failing_pvesh_path(pve_host, path: str, message: str):
    """pvesh fails on `path` with `message`, as a broken cluster filesystem makes it."""
    settings_file = pve_host.state_dir / "host.json"
    before = settings_file.read_text()
    settings = json.loads(before)
    settings["failing_paths"] = {path: message}
    settings_file.write_text(json.dumps(settings))
    try:
        yield
    finally:
        settings_file.write_text(before)


# -- a stopped container -------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "Error: "])  # pve-container < 4.0 added "Error: "
def test_pct_exec_on_a_stopped_container_is_container_not_running(prefix):
    result = CommandResult(
        pct.exec_argv(200, ["true"]), 255, b"", f"{prefix}container '200' not running!\n".encode()
    )
    error = pct.container_error(result, 200)
    assert isinstance(error, pct.ContainerNotRunning)
    assert "pct start 200" in error.hint


def test_commands_on_a_stopped_container_say_so_and_how_to_start_it(
    make_container, write_config, tmp_path
):
    make_container(201, running=False)
    path = write_config(tmp_path, vmid=201)
    for command in (["runs"], ["stop"], ["restart", "--detach"]):
        result = cli(*command, "-c", str(path))
        assert result.returncode == 3, (command, result.stderr)
        assert "container 201 is not running" in result.stderr, command
        assert "pct start 201" in result.stderr
        assert "Python 3.6" not in result.stderr


def test_logs_follow_on_a_stopped_container_ends_at_once(make_container, write_config, tmp_path):
    make_container(201, running=False)
    path = write_config(tmp_path, vmid=201)
    result = cli("logs", "-f", "-c", str(path))
    assert result.returncode == 3
    assert "reconnecting" not in result.stderr  # final at once: no minutes of retrying
    assert "container 201 is not running" in result.stderr
    assert "reconnecting" not in result.stderr


# -- a small /tmp in the container ----------------------------------------------------------


def test_a_container_with_a_small_tmp_still_takes_a_big_archive(
    make_container, write_config, tmp_path
):
    """The archive streams into the release: it is never staged in /tmp (room there
    for the agent's cached copy, about 66 KB, only)."""
    container = make_container(200, running=False)
    source = write_trainer(tmp_path / "src")
    path = write_config(
        tmp_path,
        trainer_source=source,
        **{"trainer.entry": "train.py", "trainer.args": ["--sleep", "60"]},
    )
    (source / "weights.bin").write_bytes(os.urandom(2 << 20))
    with small_tmp(container, "160k"):
        result = cli("deploy", "--detach", "--json", "-c", str(path))
        assert result.returncode == 0, result.stderr
        release = container.host_path(
            f"{WORKDIR}/releases/{flat(json.loads(result.stdout))['release']}"
        )
        assert (release / "weights.bin").read_bytes() == (source / "weights.bin").read_bytes()


# -- pct exec's environment ------------------------------------------------------------------


ENV_TRAINER = r"""
import json, os, shutil
keys = ("PATH", "HOME", "SSH_CONNECTION", "FAKEPVE_STATE", "FROM_CONFIG")
print("env " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
print("python3 is " + str(shutil.which("python3")), flush=True)
"""


def test_python3_in_usr_local_bin_and_the_login_environment(
    container, write_config, tmp_path, capsys
):
    """A stock Debian container whose python3 is in /usr/local/bin: doctor is green, and
    deploy, start and follow work first try; the trainer sees the container's login
    environment plus trainer.env, not the SSH session's variables."""
    assert container.exec(["sh", "-c", "command -v python3"]).stdout == "/usr/local/bin/python3\n"
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text(ENV_TRAINER)
    path = write_config(
        tmp_path,
        trainer_source=source,
        **{
            "container.python": "python3",
            "trainer.entry": "train.py",
            "trainer.args": [],
            "trainer.env": {"FROM_CONFIG": "yes"},
        },
    )
    doctor = cli("doctor", "--json", "-c", str(path))
    checks = {c["name"]: c for c in flat(json.loads(doctor.stdout))["checks"]}
    assert doctor.returncode == 0, checks
    assert checks["python"]["status"] == "pass"
    assert checks["python"]["detail"].endswith("(/usr/local/bin/python3)")

    result = cli("deploy", "-c", str(path))
    assert result.returncode == 0, result.stderr
    log = next(container.host_path(f"{WORKDIR}/runs").glob("*/train.log")).read_text()
    env = json.loads(log.split("env ", 1)[1].splitlines()[0])
    assert "/usr/local/bin" in env["PATH"].split(":")
    assert env["HOME"] == "/root" and env["FROM_CONFIG"] == "yes"
    assert env["SSH_CONNECTION"] is None and env["FAKEPVE_STATE"] is None
    assert "python3 is /usr/local/bin/python3" in log


def test_the_interpreter_not_found_says_which_and_what_to_set(container, write_config, tmp_path):
    path = write_config(tmp_path, **{"container.python": "python9"})
    result = cli("runs", "-c", str(path))
    assert result.returncode == 3
    assert "python9" in result.stderr and "container.python" in result.stderr


# -- starting a container: WARNINGS, HA, slow starts -----------------------------------------


def test_a_start_with_warnings_is_a_success_and_shows_them(make_container, write_config, tmp_path):
    container = make_container(201, running=False)
    container.configure(start_warnings=["prestart hook: /dev/nvidia-caps not found"])
    source = write_trainer(tmp_path / "src")
    path = write_config(
        tmp_path,
        vmid=201,
        trainer_source=source,
        **{"trainer.entry": "train.py", "trainer.args": ["--exit", "0"]},
    )
    result = cli("deploy", "--detach", "--start-container", "-c", str(path))
    assert result.returncode == 0, result.stderr
    assert "started container 201" in result.stderr
    assert "started with warnings: WARNINGS: 1" in result.stderr
    assert container.is_running()


def test_an_ha_managed_start_waits_until_the_container_runs(make_container, write_config, tmp_path):
    container = make_container(201, running=False)
    container.configure(ha=1.5)  # ha-manager starts it 1.5 s after the task ended OK
    config = load_config(write_config(tmp_path, vmid=201))
    with connect(config) as connection:
        status = proxmox.start_container(connection.proxmox, "pve", 201, timeout=30)
    assert status.running and container.is_running() and status.warnings is None


def test_the_start_timeout_is_a_setting_and_a_slow_start_says_so(
    make_container, write_config, tmp_path
):
    assert load_config(write_config(tmp_path / "a")).proxmox.start_timeout_s == 300
    container = make_container(201, running=False)
    container.configure(start_delay_s=4)
    config = load_config(write_config(tmp_path / "b", vmid=201, **{"proxmox.start_timeout_s": 1}))
    with connect(config) as connection:
        with pytest.raises(HostError) as caught:
            proxmox.start_container(connection.proxmox, "pve", 201, timeout=1)
    assert caught.value.message == "container 201 did not start within 1 s"
    assert "proxmox.start_timeout_s" in caught.value.hint


def test_task_text_before_the_upid_is_tolerated():
    upid = "UPID:pve:0000B2A1:0001F0C2:674B1C2E:vzstart:200:root@pam:"
    assert proxmox._upid_in(upid) == upid
    # proxmoxer's serializer gives up when the text shares the JSON's line.
    assert proxmox._upid_in({"errors": f'WARN: hook said hi "{upid}"'.encode()}) == upid
    assert proxmox.task_succeeded("OK") and proxmox.task_succeeded("WARNINGS: 3")
    assert not proxmox.task_succeeded("startup for container '200' failed")


# -- doctor ----------------------------------------------------------------------------------


def test_doctor_goes_on_past_a_failing_version_call(pve_host, container, write_config, tmp_path):
    path = write_config(tmp_path)
    with failing_pvesh_path(pve_host, "version", "ipcc_send_rec[1] failed: Connection refused"):
        result = cli("doctor", "--json", "-c", str(path))
    checks = {c["name"]: c for c in flat(json.loads(result.stdout))["checks"]}
    assert result.returncode == 3
    assert checks["Proxmox API answers"]["status"] == "fail"
    assert "ipcc_send_rec" in checks["Proxmox API answers"]["detail"]
    assert checks["container runs"]["status"] == "pass"
    assert checks["python"]["status"] == "pass"


def test_pct_push_logs_a_task_and_unknown_vmids_get_the_running_message(pve_host, container):
    source = Path(pve_host.state_dir) / "payload"
    source.write_text("x")
    out = pve_host.run("pct", "push", "999", str(source), "/root/x")
    assert out.returncode == 255 and out.stderr == "can only push files to a running CT\n"
    assert pve_host.run("pct", "push", "200", str(source), "/root/x").returncode == 0
    tasks = [json.loads(p.read_text()) for p in (pve_host.state_dir / "tasks").iterdir()]
    assert any(t["type"] == "push_file" and t["id"] == "200" for t in tasks)
