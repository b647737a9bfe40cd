"""A redeploy after a finished run, and a `latest` pointer naming a missing step.

The demo's loop, through the CLI as `make demo`, `make demo-crash` and
`make demo-recover` call it, in an order that broke before: a finished run is not one
to continue (its checkpoint has no steps left), so the next deploy starts a new
training at step 0, or continues it when train.steps was raised; and says so, the dry
run included.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflashctl.agent import lineage

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "trainer"
sys.path.insert(0, str(TRAINER))
from dflash.pipeline import checkpointing as ckpt  # noqa: E402

from tests.json_answers import flat  # noqa: E402

STEPS = 8
# The demo's recipe, smaller: seconds of data making, not a minute.
QUICK = [
    "--set",
    f"train.steps={STEPS}",
    "--set",
    "train.log_every=1",
    "--set",
    "train.checkpoint_every=4",
    "--set",
    "eval.enabled=false",
    "--set",
    "data.num_samples=8",
    "--set",
    "data.seq_len=32",
    "--set",
    "data.batch_size=2",
]
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \|", re.M)


@pytest.fixture
def demo_config(tmp_path, monkeypatch):
    """templates/demo.yaml, with its workdir here and the quick recipe."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = yaml.safe_load((ROOT / "templates" / "demo.yaml").read_text())
    config["container"].update(workdir=str(tmp_path / "demo"), python=sys.executable)
    config["trainer"]["source"] = str(TRAINER)
    config["trainer"]["args"] = list(config["trainer"]["args"]) + QUICK
    path = tmp_path / "dflash.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def dflashctl(config: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH")}
    head = 2 if args[:2] == ("runs", "show") else 1
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", *args[:head], "--config", str(config), *args[head:]],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(env, COLUMNS="200"),
    )


def run_id_of(proc: subprocess.CompletedProcess) -> str:
    return re.search(r"launched run (\S+)", proc.stderr + proc.stdout).group(1)


def steps_of(workdir: Path, run_id: str) -> list[int]:
    text = (workdir / "runs" / run_id / "train.log").read_text()
    return [int(m.group(1)) for m in STEP_LINE.finditer(text)]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # eight deploys: minutes on a busy 2-core machine
def test_the_demo_runs_again_and_again_in_any_order(demo_config, tmp_path):
    workdir = tmp_path / "demo"
    first = dflashctl(demo_config, "deploy")
    assert first.returncode == 0, first.stdout + first.stderr
    first_id = run_id_of(first)
    # The start-up says what it does before the first step (no silent minute).
    text = (workdir / "runs" / first_id / "train.log").read_text()
    assert text.index("start-up: importing torch") < text.index("generating 8 samples")

    # The dry run says what the deploy will do: a new training, not a refused resume.
    plan = dflashctl(demo_config, "deploy", "--dry-run")
    assert plan.returncode == 0, plan.stderr
    said = f"starts a new training at step 0, as run {first_id} finished at step {STEPS}"
    assert said in plan.stdout
    # It reads train.steps as the trainer will: from the recipe's --set, and from the
    # --set given to this deploy.
    assert f"{said} and train.steps is {STEPS}" in plan.stdout
    raised = dflashctl(demo_config, "deploy", "--dry-run", "--", "--set", "train.steps=900")
    assert raised.returncode == 0, raised.stderr
    assert f"continues run {first_id} at step {STEPS}" in raised.stdout
    assert "train.steps is now 900" in raised.stdout and said not in raised.stdout
    planned = dflashctl(demo_config, "deploy", "--dry-run", "--json")
    continues = flat(json.loads(planned.stdout))["continues"]
    assert (continues["run_id"], continues["step"], continues["finished"]) == (
        first_id,
        STEPS,
        True,
    )

    # `make demo` again: a new training from step 0, said at launch and in the log.
    second = dflashctl(demo_config, "deploy")
    assert second.returncode == 0, second.stdout + second.stderr
    out = second.stdout + second.stderr
    assert said in out
    assert f"resume: run {first_id} finished at step {STEPS}" in out
    second_id = run_id_of(second)
    assert steps_of(workdir, second_id)[0] == 1
    # A new training continues nothing: `runs` and `runs show` say no lineage.
    listed = flat(json.loads(dflashctl(demo_config, "runs", "--json").stdout))["runs"]
    row = next(r for r in listed if r["id"] == second_id)
    assert row["continued"] is False
    table = dflashctl(demo_config, "runs").stdout
    assert f"{first_id}@" not in table, table
    shown = dflashctl(demo_config, "runs", "show", second_id)
    assert "lineage" not in shown.stdout and f"step {STEPS}/{STEPS}" in shown.stdout

    # train.steps raised: the finished training goes on from its last checkpoint.
    longer = dflashctl(demo_config, "deploy", "--", "--set", f"train.steps={STEPS + 4}")
    assert longer.returncode == 0, longer.stdout + longer.stderr
    longer_id = run_id_of(longer)
    assert f"resuming run {second_id} at step {STEPS}" in longer.stdout + longer.stderr
    assert steps_of(workdir, longer_id) == list(range(STEPS + 1, STEPS + 5))
    assert f"{second_id}@{STEPS}" in dflashctl(demo_config, "runs").stdout
    # Its curve goes on from the run it continued, and says whose the first part is.
    shown = dflashctl(demo_config, "runs", "show", longer_id)
    assert f"steps up to {STEPS} are run {second_id}'s" in shown.stdout, shown.stdout
    answer = flat(json.loads(dflashctl(demo_config, "runs", "show", longer_id, "--json").stdout))
    (curves,) = answer["runs"]
    assert [r["step"] for r in curves["steps"]] == list(range(STEPS + 1, STEPS + 5))
    assert [r["step"] for r in curves["inherited_steps"]] == list(range(1, STEPS + 1))
    assert curves["inherited"] == [{"run": second_id, "first_step": 1, "last_step": STEPS}]

    # `make demo-crash` after a finished run: it starts, and crashes where it is told to.
    crash = dflashctl(demo_config, "deploy", "--", "--set", "debug.fail_in=drafter-0@step:3")
    assert crash.returncode == 1, crash.stdout + crash.stderr
    assert "injected failure in drafter-0 at step 3" in crash.stdout + crash.stderr
    crash_id = run_id_of(crash)
    # Its own records only: two steps, no lineage, no eval of the finished run.
    shown = dflashctl(demo_config, "runs", "show", crash_id)
    assert f"step 2/{STEPS}" in shown.stdout and "lineage" not in shown.stdout, shown.stdout
    assert "eval " not in shown.stdout and "steps up to" not in shown.stdout

    # `make demo` after that crash (it wrote no checkpoint): the crashed run took over
    # the finished one's checkpoint, and the next run again starts a new training.
    again = dflashctl(demo_config, "deploy")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"finished at step {STEPS + 4}" in again.stdout + again.stderr
    assert steps_of(workdir, run_id_of(again))[0] == 1
    assert json.loads((workdir / "runs" / crash_id / "meta.json").read_text())["resumed_finished"]

    # `make demo-recover` after a finished run: killed once at step 6, its supervisor
    # restarts it from its own step-4 checkpoint, and it finishes.
    marker = tmp_path / "fail-once"
    recover = dflashctl(
        demo_config,
        "deploy",
        "--",
        *("--set", "debug.fail_in=drafter-0@step:6", "--set", "debug.fail_kind=sigkill"),
        *("--set", f"debug.fail_once_marker={marker}"),
    )
    assert recover.returncode == 0, recover.stdout + recover.stderr
    out = recover.stdout + recover.stderr
    assert "starts a new training at step 0" in out and "resumed at step 4" in out

    # --fresh says it is --fresh, not that the replaced run left no checkpoint.
    fresh = dflashctl(demo_config, "deploy", "--fresh")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    out = fresh.stdout + fresh.stderr
    assert "starts at step 0 (--fresh)" in out and "left no checkpoint" not in out

    # A run that logged no step says so, in text, JSON and the PNG (no empty axes).
    early = dflashctl(demo_config, "deploy", "--", "--set", "debug.fail_in=drafter-0@warmup")
    assert early.returncode == 1, early.stdout + early.stderr
    early_id = run_id_of(early)
    png = tmp_path / "early.png"
    shown = dflashctl(demo_config, "runs", "show", early_id, "--png", str(png))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "no step logged yet" in shown.stdout and "progress" in shown.stdout
    assert f"step {STEPS}/" not in shown.stdout
    answer = flat(json.loads(dflashctl(demo_config, "runs", "show", early_id, "--json").stdout))
    (curves,) = answer["runs"]
    assert curves["no_step_logged"] is True and curves["steps"] == [] and curves["evals"] == []
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[0] == 200  # one line of text, not three axes


def test_a_latest_pointer_naming_a_missing_step_falls_back_to_the_newest_on_disk(tmp_path):
    """A run killed while it moved `latest` (or a folder removed by hand): the agent and
    the trainer both take the newest complete step folder, not step 0."""
    workdir = tmp_path / "w"
    checkpoints = workdir / "runs" / "a" / "outputs" / "checkpoints"
    for step in (5, 15):
        folder = checkpoints / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / ckpt.STATE_FILE).write_bytes(b"state")
    (checkpoints / ".step-000020.tmp-77").mkdir()  # half-written, never taken
    (checkpoints / ".step-000020.tmp-77" / ckpt.STATE_FILE).write_bytes(b"half")
    (checkpoints / "latest").write_text("step-000020\n")
    newest = checkpoints / "step-000015"

    found = lineage.latest_checkpoint(str(workdir), "a")
    assert (found["checkpoint"], found["step"]) == (str(newest), 15)
    assert ckpt.latest_checkpoint(checkpoints.parent) == newest

    # A step folder without its state file is not complete (for the trainer).
    (checkpoints / "step-000017").mkdir()
    assert ckpt.latest_checkpoint(checkpoints.parent) == newest
    # No pointer at all (killed before the first one was written): the same.
    (checkpoints / "latest").unlink()
    assert ckpt.latest_checkpoint(checkpoints.parent) == newest
    # A pointer that names a complete folder is still the answer.
    (checkpoints / "latest").write_text("step-000005\n")
    assert ckpt.latest_checkpoint(checkpoints.parent) == checkpoints / "step-000005"


def test_a_finished_run_is_handed_on_as_finished(tmp_path):
    workdir = tmp_path / "w"
    runs = workdir / "runs"
    folder = runs / "a" / "outputs" / "checkpoints" / "step-000600"
    folder.mkdir(parents=True)
    (folder / "state").write_text("x")
    (folder.parent / "latest").write_text("step-000600\n")
    (runs / "a" / "exit_code").write_text("0\n")
    assert lineage.latest_checkpoint(str(workdir), "a")["finished"] is True
    env = lineage.resume_env(lineage.latest_checkpoint(str(workdir), "a"))
    assert env["DFLASH_RESUMED_FINISHED"] == "1"
    # A run that crashed (exit 1) is continued: its checkpoint is not an end.
    (runs / "a" / "exit_code").write_text("1\n")
    assert lineage.latest_checkpoint(str(workdir), "a")["finished"] is False


def test_a_step_0_checkpoint_of_a_resumed_run_does_not_hide_its_parents_step(tmp_path):
    """An older trainer stopped during a resumed run's warm-up wrote `step-000000`
    (the parent's weights, the step counter at 0): the next run continues the parent's
    step-95 checkpoint, not step 0."""
    workdir = tmp_path / "w"
    runs = workdir / "runs"
    parent = runs / "a" / "outputs" / "checkpoints" / "step-000095"
    parent.mkdir(parents=True)
    (parent / ckpt.STATE_FILE).write_bytes(b"state")
    zero = runs / "b" / "outputs" / "checkpoints" / "step-000000"
    zero.mkdir(parents=True)
    (zero / ckpt.STATE_FILE).write_bytes(b"state")
    (zero.parent / "latest").write_text("step-000000\n")
    meta = {"resumed_from": "a", "resumed_step": 95, "resumed_checkpoint": str(parent)}
    (runs / "b" / "meta.json").write_text(json.dumps(meta))
    found = lineage.latest_checkpoint(str(workdir), "b")
    assert (found["run_id"], found["checkpoint"], found["step"]) == ("a", str(parent), 95)
    # A new training after a finished run counts from 0: its own checkpoints are its own.
    (runs / "b" / "meta.json").write_text(json.dumps(dict(meta, resumed_finished=True)))
    assert lineage.latest_checkpoint(str(workdir), "b")["checkpoint"] == str(zero)
