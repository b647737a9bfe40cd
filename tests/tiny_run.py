"""The real trainer's tiny CPU run, shared by the tests that check what it writes
(pulled in by tests/conftest.py; it runs once per test session, and only when a test
asks for `tiny_runs`)."""

from __future__ import annotations

import json
import os
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


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory) -> dict[str, TinyRun]:
    """The real trainer, three times at once: a clean run, one whose drafter fails at step
    25, one stopped after step 25."""
    base = tmp_path_factory.mktemp("runs")
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
