"""The trainer end to end with the real DFlash drafter and the tiny random Qwen3 target."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dflash.dflash_workload import DFlashWorkload
from dflash.pipeline.logging import RunLog
from dflash.pipeline.run import train
from dflash.pipeline.train_config import load_train_config

TRAINER = Path(__file__).resolve().parents[1] / "trainer"


@pytest.mark.slow
def test_tiny_cpu_demo_learns_and_reports(tmp_path):
    run_dir = tmp_path / "runs" / "20261129-101502-a1b2"
    proc = subprocess.run(
        [sys.executable, "train_dflash_pipeline.py", "--config", "configs/tiny-cpu.yaml"],
        cwd=TRAINER,
        capture_output=True,
        text=True,
        # A bound on a hung run, not a speed check (bench/ measures speed): a few times
        # the demo's ~20 s, for a machine shared with other work.
        timeout=300,
        env={**os.environ, "DFLASH_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1"},
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[-1] == "training complete"
    assert "drafter-0 on cpu: warming up" in lines  # eager: nothing is compiled
    losses = [
        float(m.group(1))
        for m in map(re.compile(r"^step \d+/600 \| loss (\S+) ").match, lines)
        if m
    ]
    assert len(losses) == 10 and losses[-1] < losses[0] - 1.5
    final = next(line for line in lines if line.startswith("final loss "))
    assert float(final.split()[2]) == pytest.approx(losses[-1], abs=1e-4)
    ev = next(line for line in lines if line.startswith("eval | "))
    checkpoint = run_dir / "outputs" / "checkpoints" / "step-000600"
    tau = re.fullmatch(
        r"eval \| tau (\S+) \| lossless yes \| \d+ tokens \| \S+ tokens/target forward"
        rf" \| checkpoint {re.escape(str(checkpoint))} \(drafter bfloat16\)"
        rf" \| per prompt: {re.escape(str(checkpoint / 'eval.json'))}",
        ev,
    )
    assert tau and float(tau.group(1)) > 1.3
    assert f"drafter checkpoint: {checkpoint}" in lines
    assert (checkpoint / "drafter" / "model.safetensors").is_file()
    assert (checkpoint / "drafter" / "config.json").is_file()


def test_real_drafter_replicas_stay_identical(tmp_path):
    cfg = load_train_config(
        TRAINER / "configs" / "tiny-cpu.yaml",
        [
            f"output_dir={tmp_path}",
            "runtime.drafter_devices=[cpu, cpu]",
            "data.num_samples=16",
            "data.batch_size=2",
            "train.steps=6",
            "train.log_every=3",
            "eval.enabled=false",
        ],
    )
    result = train(cfg, DFlashWorkload(cfg), RunLog(io.StringIO()), handle_signals=False)
    assert result.exit_code == 0 and result.completed_steps == 6
    first, second = (dict(r.model.named_parameters()) for r in result.replicas)
    trained = [name for name, p in first.items() if p.requires_grad]
    assert trained
    for name in trained:
        assert torch.equal(first[name], second[name]), name
    # The frozen target embedding and LM head are shared, not trained, not saved.
    assert not any(p.requires_grad for name, p in first.items() if name not in trained)


@pytest.mark.slow
def test_compile_default_trains_like_eager_on_cpu(tmp_path):
    from tests.pipeline_standin import run_standin

    sections = dict(train={"steps": 8, "log_every": 4}, runtime={"warmup_iters": 2})
    eager, _ = run_standin(tmp_path / "eager", **sections)
    compiled, log = run_standin(
        tmp_path / "compiled", **{**sections, "runtime": {"warmup_iters": 2, "compile": "default"}}
    )
    assert compiled.exit_code == 0 and "training complete" in log.lines
    for (s1, l1), (s2, l2) in zip(eager.history, compiled.history, strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, rel=1e-4, abs=1e-5)
