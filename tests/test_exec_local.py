"""exec and shell on this machine (host.address local): trainer.env never rides on a
command line, `python` is the run's interpreter, and a shell without a terminal is
refused instead of waiting at its prompt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from dflashctl.config.schema import load_config
from dflashctl.ops import attach
from dflashctl.remote.nodes import node_sessions

SECRET = "wandb-key-5f1e2d3c"


def _config(tmp_path: Path, python: str) -> Path:
    workdir = tmp_path / "workdir"
    workdir.mkdir(exist_ok=True)
    config = {
        "host": {"address": "local"},
        "container": {"vmid": None, "workdir": str(workdir), "python": python},
        "trainer": {"env": {"WANDB_API_KEY": SECRET}},
    }
    path = tmp_path / "dflash.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _cli(tmp_path: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)}
    env.pop("DFLASHCTL_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        **kwargs,
    )


def test_the_exec_command_line_carries_no_trainer_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    config = load_config(_config(tmp_path, sys.executable))
    with node_sessions(config) as nodes:
        node = nodes[0]
        ticket = attach.leave_ticket(node.config, node.target, ["env"], describe=False)
        argv = attach.remote_argv(node.config, node.target, ticket)
        # What any user of the host sees in /proc/<pid>/cmdline.
        assert SECRET not in "\0".join(argv)
        assert os.stat(ticket).st_mode & 0o077 == 0
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"WANDB_API_KEY={SECRET}\n" in done.stdout
    assert not os.path.exists(ticket)  # read once, then gone


def test_exec_passes_trainer_env_to_the_command(tmp_path):
    _config(tmp_path, sys.executable)
    done = _cli(tmp_path, "exec", "--", "sh", "-c", 'echo "key=$WANDB_API_KEY"')
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"key={SECRET}\n"


def test_exec_python_is_the_interpreter_the_run_uses(tmp_path):
    # container.python in a folder of its own, as a venv's bin/ is; not on PATH.
    folder = tmp_path / "venv" / "bin"
    folder.mkdir(parents=True)
    for name in ("python", "python3"):
        (folder / name).symlink_to(sys.executable)
    path = _config(tmp_path, str(folder / "python"))
    done = _cli(
        tmp_path, "exec", "-c", str(path), "--", "sh", "-c", "command -v python; command -v python3"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(folder / "python"), str(folder / "python3")]


def test_shell_without_a_terminal_is_refused_not_left_waiting(tmp_path):
    _config(tmp_path, sys.executable)
    done = _cli(tmp_path, "shell", stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "shell needs a terminal" in done.stderr and "dflashctl exec" in done.stderr
