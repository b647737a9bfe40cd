"""bench/bench_eval_cost.py --cudnn-both on CPU (tiny-cpu.yaml): the eval timed cold."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_cudnn_both_times_the_eval_as_shipped_and_leaves_the_switch_as_found(capsys):
    sys.path.insert(0, str(BENCH))
    import bench_eval_cost
    import torch

    switch = getattr(torch.backends.cuda, "cudnn_sdp_enabled", None)
    before = switch() if switch else None
    assert bench_eval_cost.main(["--cudnn-both", "--prompts", "3", "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    # CPU: the shipped round only (the cuDNN round is the GPU's)
    (line,) = [x for x in out.splitlines() if x.startswith("eval 3 x 5")]
    assert "cold (as shipped" in line and "lossless True" in line, out
    assert "cuDNN attention left on" not in out
    assert (switch() if switch else None) == before
