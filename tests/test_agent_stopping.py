"""The agent's stop (agent/stopping.py) on real processes of this machine: a trainer
started by hand from under the workdir is found (and one of another workdir is not),
SIGTERM ends it within its grace period, and one that ignores SIGTERM gets SIGKILL
when the grace period runs out."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashctl.agent.stopping import find_targets, stop_targets

TRAINER = """\
import pathlib, signal, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
pathlib.Path(sys.argv[2]).write_text("ready")
time.sleep(120)
"""


def start_by_hand(workdir: Path, on_term: str) -> subprocess.Popen:
    source = workdir / "src"
    source.mkdir(parents=True, exist_ok=True)
    (source / "train.py").write_text(TRAINER)
    ready = workdir / f"ready-{on_term}"
    proc = subprocess.Popen(
        [sys.executable, str(source / "train.py"), on_term, str(ready)],
        cwd=workdir,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the trainer did not start"
        time.sleep(0.02)
    return proc


@pytest.fixture
def started():
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_hand_started_trainer_is_found_only_in_its_workdir_and_sigterm_ends_it(tmp_path, started):
    mine, other = tmp_path / "mine", tmp_path / "other"
    started.append(start_by_hand(mine, "exit"))
    started.append(start_by_hand(other, "exit"))

    [target] = find_targets(str(mine), "train.py")
    assert target["kind"] == "stale" and target["pid"] == started[0].pid and target["group"]

    [report] = stop_targets(str(mine), [target], grace_s=30)
    assert report["ended"] == "terminated" and report["pid"] == started[0].pid
    assert started[0].wait(timeout=30) == -15
    assert started[1].poll() is None  # the other workdir's trainer runs on
    assert find_targets(str(mine), "train.py") == []


def test_a_trainer_ignoring_sigterm_is_killed_when_the_grace_runs_out(tmp_path, started):
    started.append(start_by_hand(tmp_path / "w", "ignore"))
    targets = find_targets(str(tmp_path / "w"), "train.py")
    [report] = stop_targets(str(tmp_path / "w"), targets, grace_s=0.3)
    assert report["ended"] == "killed"
    assert started[0].wait(timeout=30) == -9


def test_nothing_to_stop_is_an_empty_report(tmp_path):
    assert find_targets(str(tmp_path), "train.py") == []
    assert stop_targets(str(tmp_path), [], grace_s=1) == []
