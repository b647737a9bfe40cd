# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""Automatic recovery with the real tiny trainer in a container of the test host (a real
sshd on loopback, `pct` over bubblewrap): a SIGKILL injected once at step 7 is recovered
from by the supervisor in the container, resuming from the step-4 checkpoint, and the
run ends with exactly the weights of a run that was never interrupted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.test_recovery import cli

pytestmark = pytest.mark.slow

WORKDIR = "/root/dflash"
TRAINER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "trainer")
# Small and quick; a checkpoint every 4 steps, so the restart repeats steps 5 and 6.
RECIPE = [
    "--config",
    "configs/tiny-cpu.yaml",
    "--set",
    "train.steps=12",
    "--set",
    "train.log_every=1",
    "--set",
    "train.checkpoint_every=4",
    "--set",
    "eval.enabled=false",
    "--set",
    "data.num_samples=16",
]
FAULT = [
    "--set",
    "debug.fail_in=drafter-0@step:7",
    "--set",
    "debug.fail_kind=sigkill",
    "--set",
    "debug.fail_once_marker=/tmp/failed-once",
]


def test_an_injected_sigkill_recovers_to_the_same_weights_as_an_uninterrupted_run(
    tmp_path, container, write_config, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_config(
        tmp_path,
        **{"trainer.args": RECIPE + FAULT, "run.retry": {"backoff_s": 0}},
    )
    done = cli("deploy", "-c", str(path), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "injected SIGKILL in drafter-0 at step 7" in out
    # Checkpoints are written in the background and logged once durable: the step-4
    # one is normally logged before the kill at step 7, but on a loaded machine it may
    # not be yet. The restart resumes from the last one logged (else from the start).
    first_attempt = out.split("dflashctl: attempt 1/4 crashed")[0]
    saved = re.findall(r"^checkpoint: (\S+/step-(\d+)) ", first_attempt, re.MULTILINE)
    resumed = int(saved[-1][1]) if saved else 0
    assert f"dflashctl: attempt 2/4, resumed at step {resumed} after killed" in out
    if saved:
        assert f"resume: continuing from {saved[-1][0]} (step {resumed})" in out
    assert "finished (exit code 0) in attempt 2, after recovering from killed" in done.stderr
    (run_dir,) = container.host_path(f"{WORKDIR}/runs").iterdir()
    attempts = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    assert [(a["category"] if a["retried"] else a["reason"]) for a in attempts] == [
        "killed",
        "finished",
    ]
    assert attempts[0]["step"] == 6
    assert attempts[0]["checkpoint"] == (saved[-1][0] if saved else None)
    final = run_dir / "outputs" / "checkpoints" / "step-000012" / "drafter" / "model.safetensors"

    # The same recipe, never interrupted, run directly on this machine.
    reference = tmp_path / "reference"
    subprocess.run(
        [sys.executable, "train_dflash_pipeline.py", *RECIPE, "--set", f"output_dir={reference}"],
        cwd=TRAINER,
        check=True,
        capture_output=True,
        timeout=600,
    )
    expected = reference / "checkpoints" / "step-000012" / "drafter" / "model.safetensors"
    assert final.read_bytes() == expected.read_bytes()
