"""Checkpoints: atomic writes, exact resume, SIGTERM writes a checkpoint and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dflash.pipeline import checkpointing as ckpt

from tests.pipeline_standin import run_standin

ROOT = Path(__file__).resolve().parents[1]


def test_interrupted_and_resumed_run_matches_an_uninterrupted_one(tmp_path):
    sections = dict(
        runtime={"drafter_devices": ["cpu", "cpu"]},
        data={"batch_size": 2},
        train={"steps": 14, "log_every": 1},
    )
    full, _ = run_standin(tmp_path / "full", **sections)
    first, log = run_standin(tmp_path / "split", debug={"stop_at_step": 6}, **sections)
    assert first.exit_code == 0 and first.completed_steps == 6
    assert any(line.startswith("stopped by") and "after step 6/14" in line for line in log.lines)
    second, log2 = run_standin(tmp_path / "split", resume=True, **sections)
    assert second.exit_code == 0 and "training complete" in log2.lines
    assert second.history[0][0] == 7
    assert first.history + second.history == full.history  # the same losses, step by step
    for a, b in zip(
        full.replicas[0].model.parameters(), second.replicas[0].model.parameters(), strict=False
    ):
        assert torch.equal(a, b)


def test_checkpoint_holds_the_whole_training_state(tmp_path):
    result, _ = run_standin(tmp_path, train={"steps": 5, "log_every": 5})
    assert result.checkpoint == tmp_path / "out" / "checkpoints" / "step-000005"
    assert ckpt.latest_checkpoint(tmp_path / "out") == result.checkpoint
    state = ckpt.load_checkpoint(result.checkpoint)
    assert state.step == 5
    assert set(state.model) == {n for n, _ in result.replicas[0].model.named_parameters()}
    assert state.optimizer["scheduler"]["last_step"] == 5
    assert state.optimizer["optimizer"]["state"]  # Adam moments
    assert {"python", "torch"} <= set(state.rng)
    assert state.config["train"]["steps"] == 5
    assert (result.checkpoint / "drafter" / "standin.pt").is_file()


def test_a_failed_write_leaves_no_checkpoint_behind(tmp_path):
    good = ckpt.TrainingState(step=1, model={}, optimizer={}, config={}, rng={})
    first = ckpt.save_checkpoint(tmp_path, good)

    def broken_export(folder):
        folder.mkdir()
        (folder / "half-written").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError):
        ckpt.save_checkpoint(
            tmp_path,
            ckpt.TrainingState(step=2, model={}, optimizer={}, config={}, rng={}),
            broken_export,
        )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000001"]
    assert ckpt.latest_checkpoint(tmp_path) == first


def _start(config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "pipeline_standin.py"),
            "--config",
            str(config),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_cwd(config),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def tmp_cwd(config: Path) -> str:
    return str(config.parent)


def _write_config(tmp_path: Path, steps: int) -> Path:
    config = tmp_path / "standin.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'out'}\n"
        "data: {seq_len: 12, batch_size: 4, num_anchors: 6}\n"
        "drafter: {block_size: 2}\n"
        f"train: {{steps: {steps}, log_every: 1}}\n"
        "runtime: {warmup_iters: 1, queue_size: 2}\n"
    )
    return config


def test_sigterm_writes_a_checkpoint_and_exits_0_then_resume_continues(tmp_path):
    config = _write_config(tmp_path, steps=1_000_000)
    proc = _start(config)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("step 5/"):
                break
        proc.send_signal(signal.SIGTERM)
        # It ends by itself after its checkpoint (a stuck one would run on to this net).
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines += rest.splitlines()
    assert proc.returncode == 0, "\n".join(lines[-30:])
    assert "received SIGTERM: finishing the current step, then writing a checkpoint" in lines
    stopped = next(line for line in lines if line.startswith("stopped by SIGTERM after step"))
    step = int(stopped.split("after step ")[1].split("/")[0])
    saved = ckpt.latest_checkpoint(tmp_path / "out")
    assert saved is not None and ckpt.load_checkpoint(saved).step == step
    assert not (saved / "drafter").exists()  # the export waits for a normal end (grace period)

    proc = _start(config, "--resume", "--set", f"debug.stop_at_step={step + 3}")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    assert f"(step {step})" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert steps[0].startswith(f"step {step + 1}/") and steps[-1].startswith(f"step {step + 3}/")


def test_demo_crash_exits_nonzero_with_the_thread_traceback(tmp_path):
    config = _write_config(tmp_path, steps=50)
    proc = _start(config, "--set", "debug.fail_in=drafter-0@warmup")
    # It exits by itself (no thread left waiting); the timeout is only a safety net.
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1
    lines = out.splitlines()
    first = lines.index("drafter-0 failed:")
    assert lines[first + 1] == "Traceback (most recent call last):"
    assert any(
        line.endswith("InjectedFailure: injected failure in drafter-0 at warmup (debug.fail_in)")
        for line in lines[first:]
    )


def test_a_stop_before_training_writes_nothing(tmp_path):
    import io
    import signal as signals

    from dflash.pipeline.logging import RunLog
    from dflash.pipeline.run import Interrupts, train

    from tests.pipeline_standin import StandInWorkload, standin_config

    cfg = standin_config(tmp_path)
    log = RunLog(io.StringIO())
    interrupts = Interrupts(log)
    interrupts._on_signal(signals.SIGTERM, None)  # arrives while the target is being built
    result = train(cfg, StandInWorkload(cfg), log, handle_signals=False, interrupts=interrupts)
    assert result.exit_code == 0 and result.completed_steps == 0 and result.checkpoint is None
    assert "stopped before training started: nothing trained, no checkpoint written" in log.lines
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_second_signal_abandons_the_current_step():
    import io
    import signal as signals

    from dflash.pipeline.logging import RunLog
    from dflash.pipeline.run import Interrupts

    log = RunLog(io.StringIO())
    interrupts = Interrupts(log)
    abandoned = []
    interrupts.abandon = lambda: abandoned.append(True)
    interrupts._on_signal(signals.SIGTERM, None)
    assert interrupts.term.is_set() and not abandoned
    interrupts._on_signal(signals.SIGINT, None)
    assert abandoned == [True]
    assert log.lines[-1] == "received SIGINT again: abandoning the current step"


def test_a_sigterm_repeated_at_once_is_the_same_stop_request():
    """`dflashctl stop` signals the process group; torchrun, in it, forwards the SIGTERM to
    its ranks: one request arriving twice must not abandon the step being checkpointed."""
    import io
    import signal as signals

    from dflash.pipeline.logging import RunLog
    from dflash.pipeline.run import Interrupts

    log = RunLog(io.StringIO())
    interrupts = Interrupts(log)
    abandoned = []
    interrupts.abandon = lambda: abandoned.append(True)
    interrupts._on_signal(signals.SIGTERM, None)
    interrupts._on_signal(signals.SIGTERM, None)
    assert interrupts.term.is_set() and not abandoned
    assert log.lines[-1] == "received SIGTERM again at once: taken as the same stop request"


def test_resume_names_the_config_keys_that_changed(tmp_path):
    run_standin(tmp_path, train={"steps": 4, "log_every": 2})
    result, log = run_standin(
        tmp_path, resume=True, train={"steps": 6, "log_every": 2}, optim={"lr": 0.01}
    )
    assert result.exit_code == 0 and result.history[0][0] == 5
    assert "resume: config differs from the checkpoint's in optim.lr, train.steps" in log.lines


def test_a_thread_stuck_in_a_call_does_not_hang_the_exit(tmp_path):
    config = _write_config(tmp_path, steps=50)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "pipeline_standin.py"),
            "--config",
            str(config),
            "--set",
            "debug.fail_in=prefetcher@step:8",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # warm-up is call 1; step 2 (call 3) never returns. Bounded queues hold at most 6
        # batches, so the prefetcher reaches step 8 only after the drafter took batch 2.
        env={**os.environ, "PYTHONUNBUFFERED": "1", "STANDIN_STALL_AT_CALL": "3"},
    )
    try:
        # The stalled call never returns in time: an exit that waited for it times out.
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    lines = out.splitlines()
    assert "prefetcher failed:" in lines
    assert "threads still running 8 s after the stop: drafter-0; exiting" in lines
