"""The trainer's exit status is its own: 1 after a failure even while a thread is still
inside torch, never SIGABRT from interpreter teardown; a clean finish exits 0 after its
exit handlers ran, without teardown either."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The stand-in workload, plus a thread outside the pipeline that is busy in torch's C++
# code (forward and backward in a loop) when the run fails at ``FAIL_IN``.
DRIVER = textwrap.dedent(
    """
    import atexit, os, sys, threading
    sys.path.insert(0, {root!r})
    import torch
    from tests.pipeline_standin import StandInWorkload
    import train_dflash_pipeline

    FAIL_IN = os.environ["FAIL_IN"]
    busy = threading.Event()

    def spin_in_torch():
        weight = torch.randn(256, 256, requires_grad=True)
        while True:
            (weight @ weight).sum().backward()
            busy.set()

    def fail(where):
        threading.Thread(target=spin_in_torch, daemon=True).start()
        busy.wait()
        raise RuntimeError(f"planted failure in {{where}}")

    class Workload(StandInWorkload):
        def batch_for(self, step, shard, num_shards):
            if FAIL_IN == "prefetcher" and step == 2:
                fail("the prefetcher")
            return super().batch_for(step, shard, num_shards)

        def evaluate(self, drafter):
            if FAIL_IN == "evaluate":
                fail("evaluate")
            return super().evaluate(drafter)

    atexit.register(lambda: print("exit handlers ran", flush=True))
    raise SystemExit(train_dflash_pipeline.main(sys.argv[1:], workload_factory=Workload))
    """
)


def _run(tmp_path: Path, fail_in: str) -> subprocess.CompletedProcess:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(root=str(ROOT)))
    config = tmp_path / "standin.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'out'}\n"
        "data: {seq_len: 12, batch_size: 4, num_anchors: 6}\n"
        "drafter: {block_size: 2}\n"
        "train: {steps: 6, log_every: 1}\n"
        "runtime: {warmup_iters: 1, queue_size: 2}\n"
    )
    return subprocess.run(
        [sys.executable, str(driver), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "FAIL_IN": fail_in},
    )


@pytest.mark.parametrize(
    "fail_in, failed_line",
    [
        (
            "prefetcher",
            "training failed: prefetcher failed: RuntimeError: planted failure in the prefetcher",
        ),
        ("evaluate", "RuntimeError: planted failure in evaluate"),
    ],
)
def test_a_failure_exits_1_while_a_thread_is_still_in_torch(tmp_path, fail_in, failed_line):
    proc = _run(tmp_path, fail_in)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert failed_line in out.splitlines()
    assert "terminate called" not in out
    # The failure path never finalizes the interpreter under a live thread.
    assert "exit handlers ran" not in out


def test_a_clean_finish_exits_0_after_its_exit_handlers(tmp_path):
    proc = _run(tmp_path, "nowhere")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = out.splitlines()
    assert "training complete" in lines
    assert lines[-1] == "exit handlers ran"  # once, and last
    assert "terminate called" not in out
