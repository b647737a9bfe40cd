# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
"""Stopping never needs free space: on a workdir whose filesystem is full to the last
byte (a real tmpfs, filled), `stop` still stops the run, exit 0, and the run is gone.

What the stop writes (the lock's holder, the run's stopped.json, the exit_code the
agent settles for a killed wrapper, the wrapper's own exit_code and its last line in
train.log) is written best effort; the signal goes whatever those writes say."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests import full_disk
from tests.json_answers import flat
from tests.test_deploy_support import (  # noqa: F401
    kill_runs,
    pid_alive,
    project,
    wait_for,
    write_local_config,
)
from tests.test_deploy_transfer import DFLASHCTL, cli_deploy


@pytest.fixture
def small_workdir(project):
    why = full_disk.mount_small_disk(project.workdir)
    if why:
        pytest.skip(why)
    yield project
    kill_runs(project.workdir)
    full_disk.unmount(project.workdir)


@pytest.mark.parametrize("on_term", ["checkpoint", "ignore"])
def test_stop_on_a_full_disk_stops_the_run(small_workdir, on_term):
    project = small_workdir
    write_local_config(project.root, args=["--sleep", "120", "--on-term", on_term])
    done = cli_deploy(project, "--json")
    assert done.returncode == 0, done.stderr
    run_id = flat(json.loads(done.stdout))["run_id"]
    pid = int((project.run_dir(run_id) / "pid").read_text())
    log = project.run_dir(run_id) / "train.log"
    # The trainer said its one line and sleeps: the full disk cannot end it on its own.
    wait_for(lambda: "hello from the trainer" in log.read_text(), what="the trainer's first line")

    full_disk.fill(project.workdir)
    assert full_disk.is_full(project.workdir)
    assert pid_alive(pid)
    stopped = subprocess.run(
        [*DFLASHCTL, "stop", "-c", str(project.config_path)],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "No space left" not in stopped.stdout + stopped.stderr
    assert not pid_alive(pid), "the run is still alive after stop"

    # Space again: the records the stop could not write do not stand in the way.
    full_disk.empty(project.workdir)
    again = cli_deploy(project, "--json")
    assert again.returncode == 0, again.stderr
