"""Resume lineage: a redeploy continues the replaced run's training.

The proof: the bundled trainer's tiny CPU run, redeployed twice mid-training with a
code change each time, continues step by step (no gap, no repeat) and ends with the
same weights, bit for bit, as one uninterrupted run. The runs stop at known steps
(`debug.hold_at_step`: the trainer trains no further until SIGTERM), so nothing here
depends on timing.
"""

# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dflashctl.agent import lineage
from dflashctl.ops.deploy import DeployOptions, deploy
from dflashctl.ops.restart import restart
from tests.json_answers import one_node
from tests.test_deploy_support import project, wait_for  # noqa: F401
from tests.test_runs import state_of

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
# The tiny CPU recipe, smaller still: seconds of data making, not a minute.
OVERRIDES = {
    "train.steps": STEPS,
    "train.log_every": 1,
    "eval.enabled": "false",
    "data.num_samples": 8,
    "data.seq_len": 32,
    "data.batch_size": 2,
}
TRAINER_ARGS = ["--config", "configs/tiny-cpu.yaml"] + [
    arg for key, value in OVERRIDES.items() for arg in ("--set", f"{key}={value}")
]
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \| loss (\S+)", re.M)


def use_bundled_trainer(project) -> None:
    shutil.rmtree(project.source)
    shutil.copytree(
        ROOT / "trainer", project.source, ignore=shutil.ignore_patterns("__pycache__", "outputs")
    )
    config = yaml.safe_load(project.config_path.read_text())
    config["trainer"].update(entry="train_dflash_pipeline.py", args=TRAINER_ARGS)
    config["run"]["stop_grace_s"] = 120  # a loaded machine: the stop checkpoint must land
    project.config_path.write_text(yaml.safe_dump(config))


def change_code(project, n: int) -> None:
    """A code change that touches no number the run computes."""
    entry = project.source / "train_dflash_pipeline.py"
    entry.write_text(entry.read_text() + f"\n# patched {n}\n")


def log_of(project, run_id: str) -> str:
    return (project.run_dir(run_id) / "train.log").read_text()


def wait_log(project, run_id: str, text: str, timeout: float = 300) -> None:
    wait_for(lambda: text in log_of(project, run_id), timeout=timeout, what=repr(text))


def steps_and_losses(text: str) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(3)) for m in STEP_LINE.finditer(text)]


def meta_of(project, run_id: str) -> dict:
    return json.loads((project.run_dir(run_id) / "meta.json").read_text())


def deploy_holding(project, hold: int | None, **options) -> dict:
    extra = ["--set", f"debug.hold_at_step={hold}"] if hold else []
    code, summary = deploy(
        project.config(), DeployOptions(detach=True, extra_args=extra, **options)
    )
    assert code == 0
    return one_node(summary)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same run, never interrupted: its final training state and its step lines."""
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = subprocess.run(
        [sys.executable, "train_dflash_pipeline.py", *TRAINER_ARGS, "--set", f"output_dir={out}"],
        cwd=ROOT / "trainer",
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out / "checkpoints" / f"step-{STEPS:06d}", steps_and_losses(proc.stdout)


def test_two_redeploys_mid_training_continue_bit_for_bit(project, uninterrupted):
    reference, reference_steps = uninterrupted
    use_bundled_trainer(project)

    first = deploy_holding(project, 4)
    assert first["resumed_from"] is None and first["replaced_run"] is None
    wait_log(project, first["run_id"], "debug: holding after step 4")

    change_code(project, 1)
    second = deploy_holding(project, 8)
    assert second["files_sent"] == 1  # the patched file only
    assert (second["resumed_from"], second["resumed_step"]) == (first["run_id"], 4)
    checkpoint_4 = project.run_dir(first["run_id"]) / "outputs" / "checkpoints" / "step-000004"
    assert second["resumed_checkpoint"] == str(checkpoint_4)
    wait_log(project, second["run_id"], "debug: holding after step 8")

    change_code(project, 2)
    third = deploy_holding(project, None)
    assert (third["resumed_from"], third["resumed_step"]) == (second["run_id"], 8)
    wait_for(
        lambda: state_of(project, third["run_id"]).status != "running", timeout=300, what="end"
    )
    assert state_of(project, third["run_id"]).status == "exited", log_of(project, third["run_id"])
    assert state_of(project, third["run_id"]).exit_code == 0

    # Each run says where it starts in its first line after `start-up: importing torch`,
    # and takes over where the last stopped.
    assert log_of(project, second["run_id"]).splitlines()[:2] == [
        "start-up: importing torch",
        f"resuming run {first['run_id']} at step 4 from {checkpoint_4}",
    ]
    chain = [steps_and_losses(log_of(project, s["run_id"])) for s in (first, second, third)]
    assert [[step for step, _ in run] for run in chain] == [
        [1, 2, 3, 4],
        [5, 6, 7, 8],
        [9, 10, 11, 12],
    ]
    assert chain[0] + chain[1] + chain[2] == reference_steps  # the same losses, as printed

    final = project.run_dir(third["run_id"]) / "outputs" / "checkpoints" / f"step-{STEPS:06d}"
    ours = torch.load(final / "training_state.pt", weights_only=False)
    theirs = torch.load(reference / "training_state.pt", weights_only=False)
    assert ours["step"] == theirs["step"] == STEPS
    assert ours["model"].keys() == theirs["model"].keys()
    for name, value in theirs["model"].items():
        assert torch.equal(ours["model"][name], value), name

    # The lineage is recorded where `runs` reads it, and the replaced runs read as stopped.
    assert meta_of(project, second["run_id"])["resumed_from"] == first["run_id"]
    assert meta_of(project, third["run_id"])["resumed_checkpoint"].endswith("step-000008")
    stopped = state_of(project, first["run_id"])
    assert stopped.status == "stopped"
    assert stopped.stopped["by"] == "deploy" and stopped.stopped["replaced_by"] == second["run_id"]
    listing = subprocess.run(
        [sys.executable, "-m", "dflashctl", "runs"],
        cwd=project.root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listing.returncode == 0, listing.stderr
    rows = {line.lstrip("* ").split()[0]: line for line in listing.stdout.splitlines()[1:]}
    assert f"{second['run_id']}@8" in rows[third["run_id"]]
    assert rows[third["run_id"]].endswith("finished (exit 0)")
    assert "stopped by deploy at " in rows[first["run_id"]]
    assert rows[first["run_id"]].endswith(f"replaced by run {second['run_id']}")


def test_a_checkpoint_that_no_longer_fits_fails_in_seconds_and_stays(uninterrupted, tmp_path):
    reference, _ = uninterrupted
    before = {p: p.read_bytes() for p in reference.rglob("*") if p.is_file()}
    proc = subprocess.run(
        [sys.executable, "train_dflash_pipeline.py", *TRAINER_ARGS]
        + ["--set", "drafter.num_layers=3", "--set", "train.steps=40"]
        + ["--set", f"output_dir={tmp_path / 'out'}"],
        cwd=ROOT / "trainer",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DFLASH_RESUME_FROM": str(reference), "DFLASH_RESUMED_RUN": "old"},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "drafter.num_layers=2" in proc.stderr and "--fresh" in proc.stderr
    assert not (tmp_path / "out").exists()
    assert {p: p.read_bytes() for p in reference.rglob("*") if p.is_file()} == before


# --------------------------------------------------------------- a trainer not ours

NOT_OURS = r"""
import os, signal, sys, time
run_dir = os.environ["DFLASH_RUN_DIR"]
print("resume-from", repr(os.environ.get("DFLASH_RESUME_FROM")), "args", sys.argv[1:], flush=True)
print("resumed-run", os.environ.get("DFLASH_RESUMED_RUN"), os.environ.get("DFLASH_RESUMED_STEP"))
step = int(sys.argv[sys.argv.index("--write") + 1]) if "--write" in sys.argv else 0
def on_term(*_):
    if step:
        ckpts = os.path.join(run_dir, "outputs", "checkpoints")
        os.makedirs(os.path.join(ckpts, f"ckpt-{step}"))
        with open(os.path.join(ckpts, "latest"), "w") as f:
            f.write(f"ckpt-{step}\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_trainer_not_ours_gets_the_checkpoint_in_env_and_placeholder(project):
    (project.source / "train.py").write_text(NOT_OURS)
    config = yaml.safe_load(project.config_path.read_text())
    config["trainer"]["args"] = ["--from={resume_from}"]
    project.config_path.write_text(yaml.safe_dump(config))

    def launch(*extra, fresh=False, again=False):
        if again:
            code, summary = restart(
                project.config(), detach=True, extra_args=list(extra), fresh=fresh
            )
        else:
            code, summary = deploy(
                project.config(), DeployOptions(detach=True, extra_args=list(extra), fresh=fresh)
            )
        assert code == 0
        wait_log(project, summary["run_id"], "ready", timeout=30)
        return summary, log_of(project, summary["run_id"])

    first, log = launch("--write", "7")
    assert "resume-from '' args ['--from=', '--write', '7']" in log  # nothing to continue yet

    second, log = launch(again=True)  # restart: writes no checkpoint of its own
    ckpt7 = project.run_dir(first["run_id"]) / "outputs" / "checkpoints" / "ckpt-7"
    assert f"resume-from {str(ckpt7)!r} args ['--from={ckpt7}']" in log
    assert f"resumed-run {first['run_id']} 7" in log
    assert second["resumed_from"] == first["run_id"] and second["resumed_step"] == 7

    # The second run left no checkpoint: the lineage hands on the one it started from.
    third, log = launch(again=True)
    assert f"resume-from {str(ckpt7)!r}" in log and third["resumed_from"] == first["run_id"]
    assert state_of(project, second["run_id"]).stopped["by"] == "restart"

    fourth, log = launch(fresh=True, again=True)
    assert "resume-from '' args ['--from=']" in log and fourth["resumed_from"] is None
    assert meta_of(project, fourth["run_id"])["resumed_from"] is None


def test_lineage_follows_runs_without_checkpoints_to_the_last_one(tmp_path):
    workdir = tmp_path / "w"
    runs = workdir / "runs"
    ckpt = runs / "a" / "outputs" / "checkpoints" / "step-000120"
    ckpt.mkdir(parents=True)
    (ckpt.parent / "latest").write_text("step-000120\n")
    (runs / "b").mkdir()
    (runs / "b" / "meta.json").write_text(json.dumps({"resumed_from": "a"}))
    (runs / "c").mkdir()
    (runs / "c" / "meta.json").write_text(json.dumps({"resumed_from": "b"}))
    expected = {"run_id": "a", "checkpoint": str(ckpt), "step": 120, "finished": False}
    assert lineage.latest_checkpoint(str(workdir), "c") == expected
    # A half-written checkpoint (named by no `latest`) is never taken.
    (ckpt.parent / ".step-000130.tmp-9").mkdir()
    assert lineage.latest_checkpoint(str(workdir), "a") == expected
    # A pointer to a folder that is gone: no checkpoint, and no loop on cycles.
    shutil.rmtree(ckpt)
    (runs / "a" / "meta.json").write_text(json.dumps({"resumed_from": "c"}))
    assert lineage.latest_checkpoint(str(workdir), "c") is None


def test_restart_keeps_the_git_provenance(project):
    git = ["git", "-C", str(project.source), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    code, deployed = deploy(project.config(), DeployOptions(detach=True))
    assert code == 0
    code, restarted = restart(project.config(), detach=True)
    assert code == 0
    for summary in (deployed, restarted):
        meta = meta_of(project, summary["run_id"])
        assert (meta["git_commit"], meta["git_dirty"]) == (head, False)
    assert meta_of(project, restarted["run_id"])["restart"] is True


def test_prune_spares_the_checkpoint_the_next_deploy_continues_from(tmp_path):
    from dflashctl.agent.verbs import op_prune

    workdir = tmp_path / "w"
    a, b, c = "20260101-000001-aaaa", "20260101-000002-bbbb", "20260101-000003-cccc"
    for rid in (a, b, c):
        (workdir / "runs" / rid).mkdir(parents=True)
        (workdir / "runs" / rid / "exit_code").write_text("0\n")
    ckpt = workdir / "runs" / a / "outputs" / "checkpoints"
    (ckpt / "step-000050").mkdir(parents=True)
    (ckpt / "latest").write_text("step-000050\n")
    # c (active) continued from a and wrote nothing yet; b is an unrelated fresh run.
    (workdir / "runs" / c / "meta.json").write_text(json.dumps({"resumed_from": a}))
    (workdir / "active_run").write_text(c + "\n")
    answer = op_prune({"workdir": str(workdir), "keep": 0})
    assert [r["id"] for r in answer["removed"]] == [b]
    assert sorted(answer["spared"]) == [a, c]
