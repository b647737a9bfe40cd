"""The resume-broadcast benchmark runs in its tiny CPU mode (2 gloo ranks) and checks
every received tensor bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_pipeline_distributed import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_mode_sends_the_state_bit_identical(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += [
        "--master-port",
        str(free_port()),
        str(ROOT / "bench" / "bench_resume_broadcast.py"),
    ]
    command += ["--shape", "tiny", "--out", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == "gloo" and results["state_bytes"] > 0
    receiver = results["ranks"][1]
    assert receiver["checked_tensors"] == 4 * 18  # 18 parameters: weight, master, 2 moments
    assert "72 tensors bit-identical" in run.stdout
