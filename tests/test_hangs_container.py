"""A trainer that deadlocks in a container of the test host: `status`, `runs` and
`logs -f` say it hangs, and `stacks` shows the deadlocked thread's frame. No clock is
asserted on: the thresholds are small (run.hang), and each check waits for a state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.json_answers import flat
from tests.tiny_run import QUICK

pytestmark = pytest.mark.slow

DFLASHCTL = [sys.executable, "-m", "dflashctl"]
# Long enough for a loaded machine to start the trainer: a safety net, never a goal.
PATIENCE_S = 400


def dflashctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASHCTL, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "120"},
    )


def wait_for(what, check, patience=PATIENCE_S):
    deadline = time.monotonic() + patience
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"never saw {what}")
        time.sleep(1)


def active_run(path):
    shown = dflashctl("status", "-c", path, "--json")
    assert shown.returncode == 0, shown.stderr
    return flat(json.loads(shown.stdout))["active_run"]


def test_a_deadlocked_trainer_is_named_hanging_and_its_stacks_show_where(
    tmp_path, container, write_config, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = str(write_config(tmp_path, **{"run.hang": {"factor": 2, "min_s": 3}}))
    deployed = dflashctl(
        "deploy",
        "-c",
        path,
        "--detach",
        "--json",
        "--",
        *QUICK,
        "--set",
        "train.steps=400",
        "--set",
        "train.log_every=2",
        "--set",
        "debug.hang_in=drafter-0@step:7",
        timeout=300,
    )
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    run_id = flat(json.loads(deployed.stdout))["run_id"]
    follower = subprocess.Popen(
        [*DFLASHCTL, "logs", "-f", run_id, "-c", path, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "120"},
    )
    try:
        # status: running, and hanging once the steps stopped.
        run = wait_for("status saying hanging", lambda: (r := active_run(path))["hanging"] and r)
        assert run["id"] == run_id and run["status"] == "running"
        assert run["progress"]["last_step"] == 6 and run["progress"]["threshold_s"] >= 3
        assert run["hang"].startswith("hanging: no step line for ")
        text = dflashctl("status", "-c", path)
        assert (
            f"run        {run_id}: running, " in text.stdout
            and "hanging: no step line" in text.stdout
        )

        listed = dflashctl("runs", "-c", path, "--json")
        (row,) = flat(json.loads(listed.stdout))["runs"]
        assert row["hanging"] is True and row["progress"]["last_step"] == 6
        assert "hanging" in dflashctl("runs", "-c", path).stdout

        stacks = dflashctl("stacks", run_id, "-c", path, "--json")
        assert stacks.returncode == 0, stacks.stderr
        answer = flat(json.loads(stacks.stdout))
        assert answer["status"] == "running" and answer["asked"] == [0] and answer["missing"] == []
        (rank0,) = answer["answers"]
        threads = {t["name"]: t for t in rank0["threads"]}
        assert {"MainThread", "drafter-0", "prefetcher"} <= set(threads)
        innermost = threads["drafter-0"]["frames"][-1]
        assert innermost["function"] == "deadlock" and innermost["file"].endswith("threads.py")

        # The trainer's own watchdog dumped too, once its steps stopped.
        def watchdog_dumps():
            asked = dflashctl("stacks", run_id, "-c", path, "--json")
            return flat(json.loads(asked.stdout))["watchdog"] if asked.returncode == 0 else None

        (dumped,) = wait_for("the watchdog's dump", watchdog_dumps)
        assert dumped["reason"] == "watchdog" and dumped["last_step"] == 6
        shown = dflashctl("stacks", run_id, "-c", path)
        assert "rank 0 (pid " in shown.stdout and "drafter-0" in shown.stdout
        assert "in deadlock" in shown.stdout

        # logs -f names it (on stderr; --json keeps stdout for the result).
        follower.send_signal(signal.SIGINT)
        out, err = follower.communicate(timeout=60)
        # In the agent's words, or the trainer's watchdog's when its line came first.
        assert any(
            f"run {run_id} is hanging: {words}" in err
            for words in ("no step line for ", "no step finished for ")
        ), err
        result = flat(json.loads(out))
        assert result["status"] == "running" and result["hanging"]["hanging"] is True
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
        dflashctl("stop", "-c", path, "--grace", "1")
    assert active_run(path)["hanging"] is False  # a stopped run is not hanging


def test_a_clean_run_is_never_hanging(tmp_path, container, write_config, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = str(write_config(tmp_path))  # run.hang's defaults
    deployed = dflashctl("deploy", "-c", path, "--", *QUICK, timeout=300)
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    assert "hanging" not in deployed.stderr and "watchdog:" not in deployed.stdout
    run = active_run(path)
    assert run["outcome"] == "finished" and run["hanging"] is False
