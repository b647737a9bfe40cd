"""The real trainer's tiny CPU run, shared by the tests that check what it writes
(pulled in by tests/conftest.py; it runs once per test session, and only when a test
asks for `tiny_runs`; with several test workers, the first one to ask trains and the
others read what it left)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TRAINER = Path(__file__).resolve().parents[1] / "trainer"
# Small enough for a few seconds of training; eval on one short prompt.
QUICK = [
    "--set",
    "train.steps=40",
    "--set",
    "train.log_every=10",
    "--set",
    "data.num_samples=32",
    "--set",
    "eval.num_prompts=1",
    "--set",
    "eval.max_new_tokens=8",
]


class TinyRun:
    def __init__(self, run_dir: Path, proc: subprocess.CompletedProcess) -> None:
        self.run_dir = run_dir
        self.exit_code = proc.returncode
        self.log = proc.stdout
        self.lines = proc.stdout.splitlines()
        self.stderr = proc.stderr

    def records(self) -> list[dict]:
        return [
            json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()
        ]


def start_tiny_run(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "train_dflash_pipeline.py",
            "--config",
            "configs/tiny-cpu.yaml",
            *QUICK,
            *extra,
        ],
        cwd=TRAINER,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "DFLASH_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1"},
    )


RUN_NAMES = ("clean", "crash", "stopped")
# The first test to ask for the runs waits for their training (minutes on a loaded
# machine), inside its own time limit: a limit for a hang, not for the training's speed.
TRAINING_WAIT_S = 1200


def pytest_collection_modifyitems(items):
    for item in items:
        if "tiny_runs" in getattr(item, "fixturenames", ()) and not item.get_closest_marker(
            "timeout"
        ):
            item.add_marker(pytest.mark.timeout(TRAINING_WAIT_S))


def _train_all(base: Path) -> dict[str, TinyRun]:
    """The real trainer, three times at once: a clean run, one whose drafter fails at step
    25, one stopped after step 25."""
    started = {
        "clean": start_tiny_run(base / "clean"),
        "crash": start_tiny_run(base / "crash", "--set", "debug.fail_in=drafter-0@step:25"),
        # As if SIGTERM came during step 25: it finishes, checkpoints and exits 0.
        "stopped": start_tiny_run(base / "stopped", "--set", "debug.stop_at_step=25"),
    }
    runs = {}
    for name, proc in started.items():
        # A safety net: three tiny runs at once on a busy 2-core machine take minutes.
        stdout, stderr = proc.communicate(timeout=900)
        runs[name] = TinyRun(
            base / name, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        )
    return runs


def _save(base: Path, runs: dict[str, TinyRun]) -> None:
    """What the other workers need of each run, next to its folder; `done` written last."""
    for name, run in runs.items():
        (base / f"{name}.json").write_text(
            json.dumps({"exit_code": run.exit_code, "stdout": run.log, "stderr": run.stderr})
        )
    (base / "done").write_text("\n")


def _load(base: Path) -> dict[str, TinyRun]:
    runs = {}
    for name in RUN_NAMES:
        saved = json.loads((base / f"{name}.json").read_text())
        proc = subprocess.CompletedProcess([], saved["exit_code"], saved["stdout"], saved["stderr"])
        runs[name] = TinyRun(base / name, proc)
    return runs


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory) -> dict[str, TinyRun]:
    """The three runs of _train_all, trained once per session: under several workers
    (PYTEST_XDIST_WORKER set) in the session's shared temporary folder, behind a lock,
    so the CPU trains them once rather than once per worker."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _train_all(tmp_path_factory.mktemp("runs"))
    base = tmp_path_factory.getbasetemp().parent / "tiny-runs"
    base.mkdir(exist_ok=True)
    with open(base.parent / "tiny-runs.lock", "w") as lock:
        # The worker holding the lock trains; the others wait here for its `done`.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (base / "done").exists():
            return _load(base)
        for name in RUN_NAMES:  # what a worker that failed while training left
            shutil.rmtree(base / name, ignore_errors=True)
        runs = _train_all(base)
        _save(base, runs)
        return runs
