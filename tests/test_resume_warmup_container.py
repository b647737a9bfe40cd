# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""A resumed run stopped during its warm-up hands its parent's progress on.

The real tiny trainer in a container of the test host (a real sshd on loopback, `pct`
over bubblewrap). The parent trains to step 3 and holds (`debug.hold_at_step`); a
redeploy continues it in a child that holds at the end of its warm-up
(`debug.hold_in_warmup`), before any step; `stop` stops the child there. The child
wrote no checkpoint, and the dry run, the next deploy and its first step all stand at
the parent's step 3, not at 0.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.test_deploy_support import wait_for
from tests.test_recovery import cli

# Three trainer starts in a container: minutes on a busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

WORKDIR = "/root/dflash"
RECIPE = [
    "--config",
    "configs/tiny-cpu.yaml",
    *("--set", "train.steps=8"),
    *("--set", "train.log_every=1"),
    *("--set", "eval.enabled=false"),
    *("--set", "data.num_samples=8"),
    *("--set", "data.seq_len=32"),
    *("--set", "data.batch_size=2"),
]
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \|", re.M)


def launched(proc) -> str:
    found = re.search(r"launched run (\S+)", proc.stdout + proc.stderr)
    assert found, proc.stdout + proc.stderr
    return found.group(1)


def test_a_resumed_run_stopped_in_its_warm_up_keeps_its_parents_step(
    tmp_path, container, write_config, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = str(write_config(tmp_path, **{"trainer.args": RECIPE, "run.stop_grace_s": 120}))
    runs = container.host_path(f"{WORKDIR}/runs")

    def log(run_id: str) -> str:
        file = runs / run_id / "train.log"
        return file.read_text() if file.exists() else ""

    hold = ("--", "--set", "debug.hold_at_step=3")
    first = cli("deploy", "-c", path, "--detach", *hold, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    parent = launched(first)
    wait_for(lambda: "debug: holding after step 3" in log(parent), 300, "the parent at step 3")

    warm = ("--", "--set", "debug.hold_in_warmup=true")
    second = cli("deploy", "-c", path, "--detach", *warm, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    child = launched(second)
    assert f"continues run {parent} at step 3" in second.stdout + second.stderr
    wait_for(lambda: "holding in warm-up" in log(child), 300, "the child in its warm-up")

    stopped = cli("stop", "-c", path, timeout=300)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    text = log(child)
    assert "before the first step: nothing trained, no checkpoint written" in text, text
    assert "step-000000" not in text
    assert not (runs / child / "outputs" / "checkpoints").exists() or not any(
        (runs / child / "outputs" / "checkpoints").iterdir()
    )

    plan = cli("deploy", "-c", path, "--dry-run", timeout=300)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert f"continues run {parent} at step 3" in plan.stdout, plan.stdout

    third = cli("deploy", "-c", path, "--detach", timeout=600)
    assert third.returncode == 0, third.stdout + third.stderr
    latest = launched(third)
    wait_for(lambda: (runs / latest / "exit_code").exists(), 900, "the next run's end")
    assert (runs / latest / "exit_code").read_text() == "0\n", log(latest)
    assert f"resuming run {parent} at step 3" in log(latest), log(latest)
    steps = [int(m.group(1)) for m in STEP_LINE.finditer(log(latest))]
    assert steps == [4, 5, 6, 7, 8], steps
    meta = json.loads((runs / latest / "meta.json").read_text())
    assert (meta["resumed_from"], meta["resumed_step"]) == (parent, 3)
