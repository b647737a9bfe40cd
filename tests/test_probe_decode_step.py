"""bench/probe_decode_step.py on CPU at a tiny shape: every measurement prints its line."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_the_probe_times_warm_steps_and_fresh_lengths_cold_and_warm(capsys):
    sys.path.insert(0, str(BENCH))
    import probe_decode_step

    assert probe_decode_step.main(["--shape", "tiny", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    for label in ("batch 1 greedy", "padded greedy (mixed lengths)", "padded greedy (one length)"):
        assert f"{label}: " in out and "ms a step" in out
    # CPU: one fresh round (the cuDNN on/off pair is the GPU's)
    fresh = [x for x in out.splitlines() if "lengths never decoded before" in x]
    assert len(fresh) == 1 and "the first time" in fresh[0], out


def test_fresh_only_skips_the_warm_steps(capsys):
    sys.path.insert(0, str(BENCH))
    import probe_decode_step

    assert probe_decode_step.main(["--shape", "tiny", "--steps", "2", "--fresh-only"]) == 0
    out = capsys.readouterr().out
    assert "greedy: " not in out and "built at" in out
    assert "lengths never decoded before" in out and "the first time" in out, out


def test_the_eval_round_times_the_zoos_eval_and_checks_it_lossless(capsys):
    sys.path.insert(0, str(BENCH))
    import probe_decode_step

    args = ["--shape", "tiny", "--steps", "2", "--fresh-only", "--eval", "--eval-tokens", "6"]
    assert probe_decode_step.main(args) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if "eval 32 prompts x 6 tokens" in x]
    assert "cold: " in line and "192 tokens, lossless True" in line, out
