"""A launch across nodes that fails on one node for want of space: no node stops its
old run (they agree at the commit barrier first), and the error says, node by node,
what each left. Node b's workdir is a small tmpfs: its release fits, the new run's
folder does not get the space a launch needs."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from dflashctl.config.schema import load_config
from dflashctl.ops.deploy import DeployOptions, deploy
from tests.json_answers import flat
from tests.test_commands_on_nodes import dflashctl, job_ports, two  # noqa: F401
from tests.test_deploy_support import pid_alive


@pytest.fixture
def small_b(two):  # noqa: F811
    workdir = two.workdirs[1]
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1000k", "tmpfs", str(workdir)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield two
    subprocess.run(["umount", "-l", str(workdir)], check=False)


def test_a_full_disk_on_one_node_stops_nothing_on_any_node(small_b):
    project = small_b
    # An old run on node a alone (node b has no run yet).
    config = load_config(project.config_path)
    code, first = deploy(config.for_node(0), DeployOptions(detach=True))
    assert code == 0
    old = first["run_id"]
    old_pid = int((project.run_dir(0, old) / "pid").read_text())
    project.write(torchrun={"nproc_per_node": 1, "address": "127.0.0.1", **job_ports()})
    done = dflashctl(project, "deploy", "--detach", "--json")
    assert done.returncode == 3, done.stdout + done.stderr
    error = flat(json.loads(done.stdout))["error"] if done.stdout.strip() else done.stderr
    text = error if isinstance(error, str) else json.dumps(error)
    assert "was launched nowhere: node gpu-b" in text and "KiB free" in text
    assert "what each node left:" in text
    assert "gpu-a: aborted: nothing stopped" in text
    assert "gpu-b: failed: nothing stopped" in text
    # Node a's old run goes on, from its old release.
    assert pid_alive(old_pid)
    current = (project.workdirs[0] / "current").resolve().name
    assert current == first["release"]
