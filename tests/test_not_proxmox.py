"""A host that is not a Proxmox VE node (no pct, no pvesh) is said as doctor says it,
by every command, whichever of the two tools it tried first; never as a missing
container.python.

The host here is this machine (host.address: local, a container configured): a real
Linux host without Proxmox's tools, as a wrong host.address would reach.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflashctl.remote import pct
from dflashctl.remote.transport.base import CommandResult

ROOT = Path(__file__).resolve().parents[1]
SAID = "is not installed on this machine: it does not look like a Proxmox VE node"
COMMANDS = [
    ["deploy"],
    ["deploy", "--dry-run"],
    ["status"],
    ["doctor"],
    ["stop"],
    ["restart"],
    ["runs"],
    ["runs", "show"],
    ["logs"],
]


@pytest.fixture
def not_proxmox(tmp_path, monkeypatch):
    if shutil.which("pct") or shutil.which("pvesh"):
        pytest.skip("this machine has pct or pvesh on PATH")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text("print('training')\n")
    config = {
        "host": {"address": "local"},
        "container": {"vmid": 200, "workdir": "/root/dfl", "python": "/usr/bin/python3"},
        "trainer": {"source": str(source), "entry": "train.py"},
    }
    path = tmp_path / "dflash.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_command_says_the_host_is_not_a_proxmox_node(not_proxmox, argv):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH")}
    proc = subprocess.run(
        [sys.executable, "-m", "dflashctl", *argv, "--config", str(not_proxmox)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(env, COLUMNS="200"),
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 3 if argv != ["doctor"] else proc.returncode != 0, said
    assert SAID in said, said
    assert "container.vmid: null" in said
    assert "container.python" not in said and "Traceback" not in said


@pytest.mark.parametrize(
    "stderr",
    [
        "exec: pct: not found\n",
        "sh: 1: pct: not found\n",
        "bash: line 1: pct: command not found\n",
        "pct: command not found\n",
    ],
)
def test_each_shell_saying_pct_is_missing_is_understood(stderr):
    result = CommandResult(["pct", "exec", "200"], 127, b"", stderr.encode())
    error = pct.container_error(result, 200, "root@pve:22")
    assert isinstance(error, pct.NotProxmoxNode)
    assert error.message.startswith("pct is not installed on root@pve:22")


def test_a_command_missing_inside_the_container_is_not_taken_for_pct():
    result = CommandResult(["pct", "exec", "200"], 127, b"", b"exec: python3: not found\n")
    assert pct.container_error(result, 200) is None
