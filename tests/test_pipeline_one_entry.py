"""One entry point, one path: the same trainer script run as a plain process, under
torchrun with one rank, and under torchrun with two ranks (gloo on CPU, the stand-in
workload) writes the same files: the same metrics.jsonl records (steps, losses, learning
rates), the same checkpoint folders and the same trained weights. A world of one is the
plain run: plain and one rank agree bitwise; two ranks of half the batch agree within
float rounding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_pipeline_distributed import ENTRY, free_port, trained_weights

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not built in"
)

STEPS = 6
COMPARED = ("kind", "step", "total_steps", "loss", "acc", "tau", "lr")


def write_config(folder: Path, batch_size: int) -> Path:
    folder.mkdir(parents=True)
    config = folder / "standin.yaml"
    config.write_text(
        f"output_dir: {folder / 'out'}\n"
        f"data: {{seq_len: 12, batch_size: {batch_size}, num_anchors: 6}}\n"
        "drafter: {block_size: 2}\n"
        "optim: {lr: 0.05, warmup_ratio: 0.1}\n"
        f"train: {{steps: {STEPS}, log_every: 2, checkpoint_every: 3}}\n"
        "runtime: {warmup_iters: 1, queue_size: 2, threads: 1}\n"
    )
    return config


def run_entry(folder: Path, *, ranks: int | None, batch_size: int) -> Path:
    """The stand-in's entry as ``python ENTRY`` (ranks None) or under torchrun."""
    config = write_config(folder, batch_size)
    command = [sys.executable, str(ENTRY), "--config", str(config)]
    if ranks is not None:
        command[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
        command[5:5] = ["--master-port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    return folder / "out"


def records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def compared(out: Path) -> list[dict]:
    return [{k: r.get(k) for k in COMPARED} for r in records(out)]


def start_config(out: Path) -> dict:
    (start,) = [r for r in records(out) if r["kind"] == "start"]
    config = start["config"]
    config.pop("output_dir")
    config["data"].pop("batch_size")  # per process: two ranks take half each
    return config


def checkpoint_files(out: Path) -> list[str]:
    folder = out / "checkpoints"
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_plain_run_and_torchrun_with_one_and_two_ranks_write_the_same_files(tmp_path):
    plain = run_entry(tmp_path / "plain", ranks=None, batch_size=4)
    one = run_entry(tmp_path / "one-rank", ranks=1, batch_size=4)
    two = run_entry(tmp_path / "two-ranks", ranks=2, batch_size=2)

    assert [r["step"] for r in records(plain) if r["kind"] == "step"] == [2, 4, 6]
    assert compared(one) == compared(plain)  # a world of one is the plain run, bitwise
    assert start_config(one) == start_config(plain) == start_config(two)
    assert checkpoint_files(one) == checkpoint_files(plain) == checkpoint_files(two)
    assert "step-000003/training_state.pt" in checkpoint_files(plain)

    for mine, theirs in zip(compared(two), compared(plain), strict=True):
        assert (mine["kind"], mine["step"], mine["lr"]) == (
            theirs["kind"],
            theirs["step"],
            theirs["lr"],
        )
        if mine["loss"] is not None:
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6)

    alone = trained_weights(plain)
    for name, value in trained_weights(one).items():
        assert torch.equal(value, alone[name]), name
    for name, value in trained_weights(two).items():
        assert (value - alone[name]).abs().max().item() <= 1e-6, name


def test_a_world_of_one_answers_every_question_by_itself():
    from dflash.pipeline.distributed import World
    from dflash.pipeline.logging import RunLog
    from dflash.pipeline.replicas import GradientAverager
    from dflash.pipeline.supervisor import Supervisor

    world = World.from_env({})  # no torchrun variables: a plain run
    assert (world.rank, world.size, world.is_main, world.where()) == (0, 1, True, "")
    world.join(RunLog(), None)  # nothing to meet: the runtime section is not even read
    assert world.coordinator is None
    world.barrier("anything")
    assert world.vote("stop", 1) == 1 and world.vote("stop", 0) == 0
    world.publish("resume", "{}")
    assert world.read("resume") == "{}"
    state = object()
    assert world.broadcast_state(state, None) is state
    tensor = torch.ones(3)
    world.broadcast_from_main([tensor])
    assert torch.equal(tensor, torch.ones(3))
    error = RuntimeError("x")
    assert world.explain(error) is error
    supervisor = Supervisor(RunLog())
    world.connect(supervisor)
    averager = world.averager(2, supervisor, lambda: False, torch.float32, 256.0)
    assert isinstance(averager, GradientAverager)
    world.finish()
    world.leave_after_failure("nothing to tell")
    world.close()
