"""Stopping runs on the local target: SIGTERM to the process group, the grace period,
SIGKILL, hand-started trainers found by their command line, unrelated processes left
alone."""

# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from dflashctl.agent import processes
from dflashctl.ops.deploy import DeployOptions, deploy
from dflashctl.ops.stop import stop_every_node, stuck_error
from tests.json_answers import flat, one_node
from tests.test_deploy_support import (  # noqa: F401
    LocalProject,
    kill_runs,
    pid_alive,
    project,
    wait_for,
    write_local_config,
)
from tests.test_runs import state_of


def stop(config, grace_s: float | None = None) -> dict:
    """`stop` on the one node of `config`: what it stopped there (its error raised)."""
    results = stop_every_node(config, grace_s)
    [result] = results
    if result.outcome.error is not None:
        raise result.outcome.error
    failure = stuck_error(results)
    if failure is not None:
        raise failure
    return {"stopped": result.stopped, "target": result.target}


@pytest.fixture
def spawned():
    """Processes a test starts itself; killed (whole group) and reaped afterwards."""
    procs: list[subprocess.Popen] = []

    def spawn(argv, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            **kwargs,
        )
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)  # its own group: children too
            else:
                proc.kill()
        except ProcessLookupError:
            pass
        proc.wait()


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def launch(project) -> dict:
    code, summary = deploy(project.config(), DeployOptions(detach=True))
    assert code == 0
    return one_node(summary)


def wait_started(project, summary) -> None:
    """Until the trainer has printed its first line (its SIGTERM handler is set)."""
    log = project.run_dir(summary["run_id"]) / "train.log"
    wait_for(lambda: "hello" in log.read_text(), what="the trainer to start")


def test_stop_gives_a_sigterm_handler_its_grace_period(project):
    summary = launch(project)
    wait_started(project, summary)
    result = stop(project.config())
    [stopped] = result["stopped"]
    assert (stopped["run_id"], stopped["pid"], stopped["ended"]) == (
        summary["run_id"],
        summary["pid"],
        "terminated",
    )
    assert stopped["exit_code"] == 0
    run_dir = project.run_dir(summary["run_id"])
    assert (run_dir / "checkpointed").read_text() == "yes\n"
    assert "SIGTERM: writing a checkpoint" in (run_dir / "train.log").read_text()
    # Stopped on purpose: recorded as such, never "finished" nor a crash.
    state = state_of(project, summary["run_id"])
    assert (state.status, state.exit_code, state.signal) == ("stopped", 0, None)
    assert state.stopped["by"] == "stop" and state.stopped["replaced_by"] is None
    assert state.ok and state.describe().startswith("stopped by stop at ")


def test_a_run_that_ignores_sigterm_is_killed_after_the_grace_period(project):
    write_local_config(project.root, args=["--sleep", "60", "--on-term", "ignore"])
    summary = launch(project)
    wait_started(project, summary)
    result = stop(project.config(), grace_s=0.5)
    [stopped] = result["stopped"]
    assert stopped["ended"] == "killed" and stopped["seconds"] >= 0.5
    assert not pid_alive(summary["pid"])
    # SIGKILL took the wrapper too; stop wrote the exit code it could not.
    state = state_of(project, summary["run_id"])
    assert (state.status, state.exit_code, state.signal) == ("stopped", 137, signal.SIGKILL)
    # `logs` reports the stop, not a crash killed (and exits 0).
    done = subprocess.run(
        [sys.executable, "-m", "dflashctl", "logs", summary["run_id"], "--json"],
        cwd=project.root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    answer = flat(json.loads(done.stdout))
    assert answer["status"] == "stopped" and answer["stopped"]["by"] == "stop"
    assert answer["crashes"] == []


def test_stop_with_nothing_running(project):
    assert stop(project.config())["stopped"] == []


def test_hand_started_trainer_is_stopped_and_unrelated_processes_survive(
    project, spawned, tmp_path
):
    summary = launch(project)
    current = project.workdir / "current"
    other_project = tmp_path / "other-project"
    shutil.copytree(project.source, other_project)
    (other_project / "other.py").write_text("import time\ntime.sleep(60)\n")
    # Someone ran the trainer by hand from the current release, in its own session...
    stale = spawned(
        [sys.executable, "-u", "train.py", "--sleep", "60"], cwd=current, start_new_session=True
    )
    # ...and, from a shell, next to unrelated work in the same process group.
    shell = spawned(
        ["sh", "-c", f"{sys.executable} {current}/train.py --sleep 60 & sleep 60 & wait"],
        start_new_session=True,
    )
    unrelated_sleep = spawned(["sleep", "60"])
    unrelated_python = spawned([sys.executable, "other.py"], cwd=other_project)
    # Without a container the machine is shared: another project's train.py is not ours.
    other_trainer = spawned(
        [sys.executable, "train.py", "--sleep", "60"], cwd=other_project, start_new_session=True
    )
    wait_for(lambda: len(children_of(shell.pid)) == 2, what="the shell's two children")
    shell_trainer, shell_sleep = sorted(
        children_of(shell.pid),
        key=lambda pid: "train.py" not in open(f"/proc/{pid}/cmdline").read(),
    )

    result = stop(project.config(), grace_s=2)
    stopped = {s["pid"]: s for s in result["stopped"]}
    assert set(stopped) == {summary["pid"], stale.pid, shell_trainer}
    assert stopped[summary["pid"]]["run_id"] == summary["run_id"]
    assert stopped[stale.pid]["run_id"] is None and stopped[stale.pid]["group"] is True
    assert stopped[shell_trainer]["group"] is False  # its group holds a shell and a sleep
    wait_for(lambda: stale.poll() is not None, what="the hand-started trainer to be reaped")
    assert not pid_alive(shell_trainer) and not pid_alive(summary["pid"])
    survivors = (
        shell.pid,
        shell_sleep,
        unrelated_sleep.pid,
        unrelated_python.pid,
        other_trainer.pid,
    )
    for survivor in survivors:
        assert pid_alive(survivor), f"pid {survivor} should not have been touched"


def test_a_second_deploy_stops_the_first_run_and_a_hand_started_one(project, spawned):
    first = launch(project)
    stale = spawned(
        [sys.executable, "train.py", "--sleep", "60"],
        cwd=project.workdir / "current",
        start_new_session=True,
    )
    unrelated = spawned(["sleep", "60"])
    wait_for(lambda: "train.py" in open(f"/proc/{stale.pid}/cmdline").read(), what="exec")
    second = launch(project)
    assert {s["pid"] for s in second["runs_stopped"]} == {first["pid"], stale.pid}
    wait_for(lambda: stale.poll() is not None, what="the hand-started trainer to end")
    assert not pid_alive(first["pid"]) and pid_alive(second["pid"])
    assert pid_alive(unrelated.pid)


@pytest.mark.parametrize(
    ("argv", "matches"),
    [
        (["python3", "train.py", "--config", "x"], True),
        (["/usr/bin/python3.11", "-u", "/root/dflash/current/train.py"], True),
        (["python", "-W", "ignore", "-X", "dev", "./train.py"], True),
        (["python3", "other/train.py"], True),  # the same script started elsewhere
        (["python3", "-c", "import train.py"], False),
        (["python3", "-m", "train"], False),
        (["python3", "-", "inspect"], False),  # the agent itself
        (["python3", "not_train.py"], False),
        (["python3", "other.py", "train.py"], False),  # train.py only as an argument
        (["/bin/sh", "launch.sh", "/run", "python3", "train.py"], False),  # the wrapper
        (["sleep", "train.py"], False),
        ([], False),
    ],
)
def test_which_command_lines_run_the_entry_script(argv, matches):
    assert processes.runs_entry(argv, "train.py") is matches


def test_cli_stop_rejects_a_negative_grace(project):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflashctl",
            "stop",
            "-c",
            str(project.config_path),
            "--grace",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--grace must be 0 or more seconds" in result.stderr


def test_worker_processes_go_with_their_trainer_and_are_reported_once(project, spawned, tmp_path):
    """Our run's workers die with its process group; a hand-started trainer that shares
    its group with a shell is stopped with its workers, and reported once."""
    run_workers, stale_workers = tmp_path / "run-workers", tmp_path / "stale-workers"
    write_local_config(
        project.root, args=["--sleep", "60", "--workers", "2", "--workers-file", str(run_workers)]
    )
    summary = launch(project)
    current = project.workdir / "current"
    shell = spawned(
        [
            "sh",
            "-c",
            f"{sys.executable} {current}/train.py --sleep 60 --workers 2 "
            f"--workers-file {stale_workers} & sleep 60 & wait",
        ],
        start_new_session=True,
    )
    wait_for(lambda: run_workers.exists() and stale_workers.exists(), what="the workers")
    wait_for(lambda: len(run_workers.read_text().split()) == 2, what="the run's workers")
    wait_for(lambda: len(stale_workers.read_text().split()) == 2, what="the stale workers")
    workers = [int(p) for p in (run_workers.read_text() + " " + stale_workers.read_text()).split()]

    result = stop(project.config(), grace_s=2)
    assert len(result["stopped"]) == 2  # the run, and the hand-started trainer
    by_kind = {s["kind"]: s for s in result["stopped"]}
    assert sorted(by_kind) == ["active", "stale"]
    assert by_kind["active"]["pid"] == summary["pid"]
    assert by_kind["stale"]["group"] is False  # its group holds the shell and a sleep
    wait_for(lambda: not any(pid_alive(w) for w in workers), what="the workers to go")
    assert pid_alive(shell.pid)


def test_two_workdirs_in_one_machine_never_stop_each_others_runs(project, tmp_path):
    """Two experiments, the same entry script name, one machine: each deploy and stop
    touches its own workdir's runs only (a run of another workdir is never "stale")."""
    other = LocalProject(tmp_path / "other")
    try:
        mine = launch(project)
        theirs = launch(other)
        wait_started(project, mine)
        wait_started(other, theirs)

        again = launch(project)
        assert [s["pid"] for s in again["runs_stopped"]] == [mine["pid"]]
        assert pid_alive(theirs["pid"])

        result = stop(other.config())
        assert [s["pid"] for s in result["stopped"]] == [theirs["pid"]]
        assert pid_alive(again["pid"])
        assert state_of(other, theirs["run_id"]).stopped["by"] == "stop"
    finally:
        kill_runs(other.workdir)
