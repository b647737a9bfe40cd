"""Faults mid-deploy leave something running and say what: Ctrl-C while the old run
is being stopped (the container side finishes the launch without us), and a workdir
too full to launch in (refused before anything is stopped)."""

# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from dflashctl.ops.deploy import DeployOptions, deploy
from tests.json_answers import flat, one_node
from tests.test_deploy_support import (  # noqa: F401
    pid_alive,
    project,
    snapshot,
    wait_for,
    write_local_config,
)
from tests.test_runs import state_of

DFLASHCTL = [sys.executable, "-m", "dflashctl"]


def launch(project) -> dict:
    code, summary = deploy(project.config(), DeployOptions(detach=True))
    assert code == 0
    summary = one_node(summary)
    log = project.run_dir(summary["run_id"]) / "train.log"
    wait_for(lambda: "hello" in log.read_text(), what="the trainer to start")
    return summary


def test_ctrl_c_while_the_old_run_is_stopped_still_launches_and_says_so(project):
    # The old run ignores SIGTERM: the stop takes the whole grace period, and the
    # launch begins only after it. Ctrl-C comes during that wait.
    write_local_config(project.root, args=["--sleep", "60", "--on-term", "ignore"])
    first = launch(project)
    write_local_config(project.root, args=["--sleep", "60"], stop_grace_s=2)
    (project.source / "helpers.py").write_text("def greeting():\n    return 'hello again'\n")
    proc = subprocess.Popen(
        [*DFLASHCTL, "deploy", "--detach"],
        cwd=project.root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
    )
    stopped = project.run_dir(first["run_id"]) / "stopped.json"
    wait_for(stopped.exists, timeout=120, what="the stop to begin")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    active = (project.workdir / "active_run").read_text().strip()
    assert active != first["run_id"]
    assert f"run {active} launched" in err and f"logs -f {active}" in err
    assert not pid_alive(first["pid"])
    assert state_of(project, active).status == "running"
    assert state_of(project, first["run_id"]).stopped["replaced_by"] == active
    assert (
        "hello again" in (project.run_dir(active) / "train.log").read_text()
        or wait_for(lambda: "hello again" in (project.run_dir(active) / "train.log").read_text())
        is None
    )


@pytest.fixture
def small_workdir(project):
    """The project's workdir on a 4 MiB tmpfs (root only: it mounts)."""
    project.workdir.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(project.workdir)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield project.workdir
    from tests.test_deploy_support import kill_runs

    kill_runs(project.workdir)
    subprocess.run(["umount", "-l", str(project.workdir)], check=False)


def test_a_workdir_too_full_to_launch_in_stops_nothing(project, small_workdir):
    first = launch(project)
    # Fill the disk to within a few pages, as a big log or checkpoint would.
    filler = small_workdir / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    filler_size = filler.stat().st_size
    os.truncate(filler, filler_size - 3 * 4096)
    (project.source / "helpers.py").write_text("def greeting():\n    return 'never'\n")
    before = {k: v for k, v in snapshot(small_workdir).items() if "train.log" not in k}

    done = subprocess.run(
        [*DFLASHCTL, "deploy", "--detach", "--json"],
        cwd=project.root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    assert "nothing was stopped" in done.stderr or "No space left" in done.stderr
    assert flat(json.loads(done.stdout))["exit_code"] == 3
    assert pid_alive(first["pid"])
    assert state_of(project, first["run_id"]).status == "running"
    after = {k: v for k, v in snapshot(small_workdir).items() if "train.log" not in k}
    # current, active_run, the runs and releases: as they were; no half-made folders.
    assert {k for k in after if not k.startswith(".")} == {
        k for k in before if not k.startswith(".")
    }
    assert after["current"] == before["current"]
