"""bench/bench_trainer.py's throughput counts every second between the windows, so a
walk or an eval that stalls training shows in it (the step lines' median would hide it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_trainer", ROOT / "bench" / "bench_trainer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(step, elapsed, tok_s=1000.0, steps_per_s=10.0, mfu=0.5):
    return {
        "kind": "step",
        "step": step,
        "elapsed_s": elapsed,
        "tokens_per_s": tok_s,
        "steps_per_s": steps_per_s,
        "mfu": mfu,
    }


def test_a_stall_between_windows_counts_in_the_throughput():
    bench = _bench()
    steady = [_record(5 * i, 0.5 * i) for i in range(1, 6)]  # 10 steps/s, 100 tokens a step
    assert bench._throughput(steady) == (pytest.approx(1000.0), pytest.approx(50.0))
    stalled = [dict(r) for r in steady]
    for r in stalled[2:]:
        r["elapsed_s"] += 1.5  # a 1.5 s walk in the second window
    tok_s, mfu = bench._throughput(stalled)
    # the second half: steps 10 to 20, 1 s of training and the 1.5 s walk
    assert tok_s == pytest.approx(100 * 10 / 2.5) and mfu == pytest.approx(20.0)
    assert bench._throughput(steady[:2]) == (None, None)  # too few windows


def test_every_measurement_can_be_switched_off_alone():
    bench = _bench()
    assert set(bench.MEASUREMENTS) == {"walk", "eval", "trackers", "stacks", "flight-recorder"}
    on_sets, on_env = bench.measurements_on(type("Args", (), {"eval_every": 7})())
    assert "eval.every=7" in on_sets and on_env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    overrides, env = bench.MEASUREMENTS["flight-recorder"]
    assert overrides == [] and all(value is None for value in env.values())


def test_the_queue_drained_after_a_first_window_stall_is_not_counted_as_speed():
    """A walk in the first window lets the target threads fill the queue; the windows
    right after drain it faster than the trainer can keep up. The second half is read."""
    bench = _bench()
    gaps = [5.0, 0.25, 0.25, 0.5, 0.5, 0.5, 0.5, 0.5]  # stall, drain, drain, steady...
    elapsed, records = 0.0, []
    for i, gap in enumerate(gaps, 1):
        elapsed += gap
        records.append(_record(5 * i, elapsed))
    tok_s, _ = bench._throughput(records)
    assert tok_s == pytest.approx(1000.0)  # the steady 10 steps/s, 100 tokens a step


def test_rounds_report_the_median_round_and_keep_every_rounds_rate():
    bench = _bench()

    def run(tok, cpu):
        return {"tokens_per_s": tok, "steps_per_s": tok and tok / 100, "cpu_s": cpu, "exit_code": 0}

    odd = bench._median_round([run(900.0, 9.0), run(1200.0, 12.0), run(1000.0, 10.0)])
    assert (odd["tokens_per_s"], odd["cpu_s"]) == (1000.0, 10.0)
    assert odd["rounds_tokens_per_s"] == [900.0, 1200.0, 1000.0]
    cut = bench._median_round([run(800.0, 8.0), run(1000.0, 9.0), run(900.0, 7.0), run(None, 6.0)])
    # A round that logged no rate (cut before its windows) is left out of the median.
    assert cut["tokens_per_s"] == 900.0 and cut["rounds_tokens_per_s"][-1] is None
    even = bench._median_round([run(800.0, 8.0), run(1000.0, 9.0)])
    assert (even["tokens_per_s"], even["steps_per_s"]) == (900.0, 9.0)
    assert bench._median_round([run(None, 5.0)])["tokens_per_s"] is None
