"""The checkpoint benchmark runs in its tiny CPU mode and measures both paths on one state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_mode_measures_before_and_after(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_checkpoint.py"),
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["trainable_params"] > 0
    sizes = {results[k]["bytes"] for k in ("before", "after_cold", "after_warm")}
    assert len(sizes) == 1 and sizes.pop() > 0  # the background writer writes the same checkpoint
    for key in ("after_cold", "after_warm"):
        assert 0 <= results[key]["stall_s"] <= results[key]["durable_s"]
    assert results["sigterm_after_periodic_s"] > 0
    assert len(results["checkpoint_log"]) == 4
    assert "| before |" in out.stdout and "| after_warm |" in out.stdout
    assert not any(tmp_path.glob("*/checkpoints/step-*"))  # cleaned up as it went
