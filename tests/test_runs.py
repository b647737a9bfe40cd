"""Run records and states on the local target: exit codes written by the launch wrapper,
states read from the real processes and files (never from the log), restart, `runs`."""

# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from dflashctl.errors import HostError
from dflashctl.ops.deploy import DeployOptions, deploy
from dflashctl.ops.restart import restart
from dflashctl.remote.connect import open_target
from dflashctl.remote.nodes import NodesFailed
from dflashctl.runs.records import RunState, active_run, get_run, list_runs, new_id, run_state
from tests.json_answers import flat, one_node
from tests.test_deploy_support import (  # noqa: F401
    pid_alive,
    project,
    wait_for,
    write_local_config,
)


def launch(project, *args: str) -> dict:
    config = project.config()
    code, summary = deploy(config, DeployOptions(detach=True, extra_args=list(args)))
    assert code == 0
    return one_node(summary)


def state_of(project, run_id: str) -> RunState:
    target = open_target(project.config())
    return run_state(target, str(project.workdir), run_id, python=sys.executable)


def wait_finished(project, run_id: str) -> RunState:
    wait_for(lambda: state_of(project, run_id).finished, timeout=120, what=f"run {run_id} to end")
    return state_of(project, run_id)


@pytest.fixture
def quick(project):
    """The project with trainer.args that end the run by themselves."""
    write_local_config(project.root, args=[])
    return project


@pytest.mark.parametrize(
    ("args", "status", "exit_code", "sig", "described"),
    [
        ((), "exited", 0, None, "finished (exit 0)"),
        (("--exit", "3"), "exited", 3, None, "crashed (exit 3)"),
        (
            ("--kill", "SIGSEGV"),
            "killed",
            128 + signal.SIGSEGV,
            signal.SIGSEGV,
            "crashed (killed by SIGSEGV)",
        ),
    ],
)
def test_exit_code_file_for_each_ending(quick, args, status, exit_code, sig, described):
    summary = launch(quick, *args)
    state = wait_finished(quick, summary["run_id"])
    assert (state.status, state.exit_code, state.signal) == (status, exit_code, sig)
    assert state.describe() == described
    run_dir = quick.run_dir(summary["run_id"])
    assert (run_dir / "exit_code").read_text() == f"{exit_code}\n"
    assert not (run_dir / "exit_code.tmp").exists()


def test_running_then_lost_when_killed_from_outside(project):
    summary = launch(project)
    assert state_of(project, summary["run_id"]).status == "running"
    # SIGKILL to the whole group (wrapper included): nobody is left to write exit_code.
    os.killpg(summary["pid"], signal.SIGKILL)
    wait_for(lambda: not pid_alive(summary["pid"]), what="the run to die")
    state = state_of(project, summary["run_id"])
    assert state == RunState("lost", None, None)
    assert state.describe() == "lost"


def test_a_recycled_pid_is_not_taken_for_the_run(project):
    summary = launch(project)
    os.killpg(summary["pid"], signal.SIGKILL)
    wait_for(lambda: not pid_alive(summary["pid"]), what="the run to die")
    # Point the run's pid file at a live process that is not the run.
    other = subprocess.Popen(["sleep", "30"])
    try:
        (project.run_dir(summary["run_id"]) / "pid").write_text(f"{other.pid}\n")
        assert state_of(project, summary["run_id"]).status == "lost"
    finally:
        other.kill()
        other.wait()


def test_list_runs_and_active_run(quick):
    first = launch(quick)
    wait_finished(quick, first["run_id"])
    second = launch(quick, "--exit", "3")
    wait_finished(quick, second["run_id"])
    target = open_target(quick.config())
    found = list_runs(target, str(quick.workdir), python=sys.executable)
    assert [r.id for r in found] == [first["run_id"], second["run_id"]]
    assert [r.state.describe() for r in found] == ["finished (exit 0)", "crashed (exit 3)"]
    assert [r.active for r in found] == [False, True]
    assert found[1].release == second["release"] and found[1].pid == second["pid"]
    assert active_run(target, str(quick.workdir), python=sys.executable).id == second["run_id"]
    with pytest.raises(HostError, match="no run"):
        get_run(target, str(quick.workdir), new_id(), python=sys.executable)


def test_active_run_is_none_before_any_deploy(project):
    target = open_target(project.config())
    assert active_run(target, str(project.workdir), python=sys.executable) is None
    assert list_runs(target, str(project.workdir), python=sys.executable) == []


def test_restart_relaunches_the_current_release_without_sync(project):
    first = launch(project)
    (project.source / "helpers.py").write_text("def greeting():\n    return 'not deployed'\n")
    code, summary = restart(project.config(), detach=True)
    assert code == 0
    summary = one_node(summary)
    assert summary["release"] == first["release"]
    assert summary["run_id"] != first["run_id"]
    assert [s["run_id"] for s in summary["runs_stopped"]] == [first["run_id"]]
    assert not pid_alive(first["pid"]) and pid_alive(summary["pid"])
    assert "not deployed" not in (project.current() / "helpers.py").read_text()


def test_restart_with_nothing_deployed_says_so(project):
    with pytest.raises(NodesFailed, match="^nothing is deployed") as info:
        restart(project.config(), detach=True)
    assert isinstance(info.value.cause, HostError)  # one node: its own error's words


def test_cli_runs_table_and_json(quick):
    summary = launch(quick, "--exit", "3")
    wait_finished(quick, summary["run_id"])
    base = [sys.executable, "-m", "dflashctl", "runs", "-c", str(quick.config_path)]
    table = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert summary["run_id"] in table.stdout and "crashed (exit 3)" in table.stdout
    as_json = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=60)
    [run] = flat(json.loads(as_json.stdout))["runs"]
    assert (run["id"], run["state"], run["exit_code"]) == (summary["run_id"], "crashed (exit 3)", 3)
    assert run["release"] == summary["release"]


def test_a_run_that_stopped_as_asked_reads_stopped_whatever_its_exit_status():
    from dflashctl.runs.records import RunInfo, RunState

    attempts = {"attempts": [{"reason": "stopped", "stop": "stopped (checkpoint at step 4)"}]}
    for state in (RunState("exited", 130), RunState("exited", 1), RunState("exited", 0)):
        info = RunInfo(id="r", state=state, attempts=attempts)
        assert info.describe_state() == "stopped (checkpoint at step 4)"
        assert info.to_json()["category"] is None
    crashed = RunInfo(id="r", state=RunState("exited", 1), attempts={"attempts": [{"reason": "x"}]})
    assert crashed.describe_state().startswith("crashed")
