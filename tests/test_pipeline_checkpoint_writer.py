"""Checkpoints written in the background: a snapshot, one write at a time, complete or absent."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from dflash.pipeline import checkpointing as ckpt

from tests.pipeline_standin import run_standin

ROOT = Path(__file__).resolve().parents[1]


def _state(step: int, weight: torch.Tensor) -> ckpt.TrainingState:
    return ckpt.TrainingState(
        step=step,
        model={"w": weight},
        optimizer={"state": {0: {"exp_avg": weight * 2}}, "masters": [weight]},
        config={"seed": 0},
        rng=ckpt.capture_rng(),
    )


class BlockingExport:
    """An export that holds the write open until released, and counts writers inside."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.release = threading.Event()
        self.active = self.peak = 0
        self.lock = threading.Lock()

    def __call__(self, weights, folder: Path) -> None:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        self.inside.set()
        self.release.wait()
        folder.mkdir()
        torch.save(weights, folder / "weights.pt")
        with self.lock:
            self.active -= 1


def test_training_goes_on_while_the_snapshot_is_written(tmp_path):
    lines: list[str] = []
    writer = ckpt.CheckpointWriter(tmp_path, lines.append)
    weight = torch.zeros(4)
    export = BlockingExport()
    assert writer.save_async(1, lambda: _state(1, weight), export)
    export.inside.wait()  # the write is in flight...
    weight.add_(1.0)  # ...and training changes the live weights
    export.release.set()
    path = writer.wait()
    saved = ckpt.load_checkpoint(path)
    assert torch.equal(saved.model["w"], torch.zeros(4))  # the state at the request
    assert torch.equal(saved.optimizer["masters"][0], torch.zeros(4))
    assert torch.equal(torch.load(path / "drafter" / "weights.pt")["w"], torch.zeros(4))
    stats = writer.stats[-1]
    assert stats.step == 1 and stats.bytes_written == ckpt.folder_bytes(path) > 0
    assert 0 <= stats.stall_s <= stats.durable_s
    assert lines == [f"checkpoint: {path} ({stats.durable_s:.1f} s)", stats.line()]


def test_two_checkpoints_are_never_written_at_once(tmp_path):
    lines: list[str] = []
    writer = ckpt.CheckpointWriter(tmp_path, lines.append)
    export = BlockingExport()
    weight = torch.zeros(2)
    assert writer.save_async(1, lambda: _state(1, weight), export)
    export.inside.wait()
    assert not writer.save_async(2, lambda: _state(2, weight), export, if_busy="skip")
    assert lines[-1] == "checkpoint at step 2 skipped: the previous one is still being written"
    waiting = threading.Thread(
        target=lambda: writer.save_async(3, lambda: _state(3, weight), export)
    )
    waiting.start()  # blocks until step 1 is written, then writes step 3
    export.release.set()
    waiting.join()
    assert writer.wait().name == "step-000003"
    assert export.peak == 1
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-000001", "step-000003"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000003"


def test_a_failed_background_write_is_logged_and_raised_by_wait(tmp_path):
    lines: list[str] = []
    writer = ckpt.CheckpointWriter(tmp_path, lines.append)

    def broken(weights, folder):
        raise OSError("disk full")

    assert writer.save_async(1, lambda: _state(1, torch.zeros(1)), broken)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    # The line names the folder and the free space there (the crash report's disk_full).
    (line,) = lines
    assert line.startswith("checkpoint at step 1 failed: OSError: disk full (writing ")
    assert "free of" in line
    assert ckpt.latest_checkpoint(tmp_path) is None
    assert writer.save(2, lambda: _state(2, torch.zeros(1))).name == "step-000002"


KILLED_MID_WRITE = """
import sys, torch
sys.path.insert(0, {trainer!r})
from dflash.pipeline import checkpointing as ckpt
out = {out!r}
state = lambda step: ckpt.TrainingState(step, {{"w": torch.full((1000,), float(step))}}, {{}}, {{}}, {{}})
writer = ckpt.CheckpointWriter(out, lambda line: None)
writer.save(1, lambda: state(1))
def export(weights, folder):
    folder.mkdir()
    (folder / "half").write_bytes(b"x" * 1000)
    print("mid-write", flush=True)
    sys.stdin.read()  # never returns: the parent kills us here
writer.save_async(2, lambda: state(2), export)
writer.wait()
"""


def test_a_kill_mid_write_leaves_the_previous_checkpoint_complete(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(KILLED_MID_WRITE.format(trainer=str(ROOT / "trainer"), out=str(tmp_path)))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "mid-write\n"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    folder = tmp_path / "checkpoints"
    assert ckpt.latest_checkpoint(tmp_path) == folder / "step-000001"
    assert not (folder / "step-000002").exists()
    assert [p for p in folder.iterdir() if ".tmp-" in p.name]  # the half-written one
    assert torch.equal(ckpt.load_checkpoint(folder / "step-000001").model["w"], torch.ones(1000))
    ckpt.CheckpointWriter(tmp_path)  # the next run's writer clears the leftover
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-000001"]


def test_resume_from_a_background_checkpoint_is_exact(tmp_path):
    sections = dict(train={"steps": 14, "log_every": 1, "checkpoint_every": 6})
    full, log = run_standin(tmp_path / "full", **sections)
    assert full.exit_code == 0
    assert any(line.startswith("checkpoint stats: step 6 |") for line in log.lines)
    # Another run directory whose latest checkpoint is the periodic one at step 6.
    source = tmp_path / "full" / "out" / "checkpoints" / "step-000006"
    target = tmp_path / "resumed" / "out" / "checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(source, target / "step-000006")
    (target / "latest").write_text("step-000006\n")
    resumed, _ = run_standin(tmp_path / "resumed", resume=True, **sections)
    assert resumed.exit_code == 0 and resumed.history[0][0] == 7
    assert resumed.history == full.history[6:]  # the same losses, step by step
    for a, b in zip(
        full.replicas[0].model.parameters(), resumed.replicas[0].model.parameters(), strict=True
    ):
        assert torch.equal(a, b)
