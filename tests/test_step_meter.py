"""The trainer's StepMeter and metrics file: window means, throughput, the time left,
metrics.jsonl records, TensorBoard events."""

from __future__ import annotations

import io
import json
import math

import pytest
from dflash.pipeline.logging import RunLog, format_eta
from dflash.pipeline.meter import StepMeter
from dflash.pipeline.metrics_file import MetricsWriter, metrics_dir
from dflash.pipeline.train_config import TrainConfigError, load_train_config


class Clock:
    """The meter's clock, moved by the test: step times without sleeping."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def meter_for(tmp_path, *, total=100, every=10, clock=None, tensorboard=False):
    log = RunLog(io.StringIO())
    writer = MetricsWriter(tmp_path, tensorboard=tensorboard)
    meter = StepMeter(
        log, total_steps=total, log_every=every, writer=writer, clock=clock or Clock()
    )
    return meter, log, writer


def add(meter, step, loss=2.0, acc=0.5, tokens=1000, queue_depth=3):
    meter.add(
        step,
        loss=loss,
        tokens=tokens,
        metrics={"acc": acc, "per_slot_acc": [acc, acc / 2]},
        tau=1.0 + acc,
        lr=1e-3,
        queue_depth=queue_depth,
        queue_size=8,
    )


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (44.6, "45s"), (192, "3m12s"), (3900, "1h05m"), (2 * 86400 + 3 * 3600, "2d03h")],
)
def test_eta_text(seconds, text):
    assert format_eta(seconds) == text


def test_window_means_rate_and_eta(tmp_path):
    clock = Clock()
    meter, log, writer = meter_for(tmp_path, clock=clock)
    meter.start()
    for step in range(1, 11):  # 10 steps, 0.5 s each
        clock.now += 0.5
        add(meter, step, loss=float(step))
    assert log.lines == [
        "step 10/100 | loss 5.5000 | acc 0.50 | tau~ 1.50 | lr 1.0e-3 | 2000 tok/s | mfu n/a "
        "| queue 3/8 | eta 45s"
    ]
    for step in range(11, 21):  # slower: 1.5 s a step; the ETA follows the recent rate
        clock.now += 1.5
        add(meter, step)
    assert log.lines[-1].endswith("| eta 1m20s")  # 80 steps x (20 s / 20 steps)
    writer.close()
    first, second = (
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    )
    assert first["kind"] == "step" and first["step"] == 10 and first["total_steps"] == 100
    assert first["loss"] == 5.5 and first["acc"] == 0.5 and first["acc_per_slot"] == [0.5, 0.25]
    assert first["tau"] == 1.5 and first["lr"] == 1e-3
    assert first["tokens_per_s"] == 2000.0 and first["steps_per_s"] == 2.0
    assert first["queue_depth"] == 3 and first["queue_size"] == 8
    assert first["mfu"] is None and first["eta_s"] == 45.0 and first["elapsed_s"] == 5.0
    assert second["eta_s"] == 80.0 and second["tokens_per_s"] == pytest.approx(666.7)
    assert meter.final_loss == 2.0


def test_last_step_always_logged_and_restart_window_drops_the_time(tmp_path):
    clock = Clock()
    meter, log, _ = meter_for(tmp_path, total=15, clock=clock)
    meter.start()
    for step in range(1, 11):
        clock.now += 1.0
        add(meter, step)
    for step in range(11, 14):
        clock.now += 1.0
        add(meter, step)
    clock.now += 100.0  # a profiler trace: no training
    meter.restart_window()
    for step in range(14, 16):
        clock.now += 1.0
        add(meter, step)
    assert [line.split(" |")[0] for line in log.lines] == ["step 10/15", "step 15/15"]
    assert "| 1000 tok/s |" in log.lines[-1]  # 2 timed steps in 2 s, the 100 s left out
    assert log.lines[-1].endswith("| eta 0s")


def test_mfu_from_flops_and_peak(tmp_path):
    clock = Clock()
    log = RunLog(io.StringIO())
    meter = StepMeter(
        log, total_steps=2, log_every=2, flops_per_step=5e12, peak_flops=1e13, clock=clock
    )
    meter.start()
    for step in (1, 2):
        clock.now += 1.0
        add(meter, step)
    assert "| mfu 50.0% |" in log.lines[0]


def test_the_last_window_does_not_count_again_the_target_forwards_of_a_drained_queue():
    """At the end the target is done and the drafter drains the queue: those batches'
    target forwards ran (and were counted) in earlier windows. Counting them again read
    103.8% MFU on an H100 for the last line of the 8B bench."""
    clock = Clock()
    log = RunLog(io.StringIO())
    meter = StepMeter(
        log,
        total_steps=10,
        log_every=5,
        flops_per_step=5e12,
        target_flops_per_step=3e12,
        peak_flops=1e13,
        clock=clock,
    )
    meter.start()
    for step in range(1, 11):
        # steady state 1 s a step, queue full; then 4 queued batches drain at 0.5 s a step
        clock.now += 1.0 if step <= 6 else 0.5
        add(meter, step, queue_depth=4 if step <= 6 else 10 - step)
    assert "| mfu 50.0% |" in log.lines[0]
    # last window: 5 drafter steps (2e12 each) + 1 target forward (3e12) in 3 s
    assert "| mfu 43.3% |" in log.lines[1]


def test_eval_record_and_non_finite_numbers_become_null(tmp_path):
    meter, _, writer = meter_for(tmp_path, total=1, every=1)
    meter.start()
    add(meter, 1, loss=math.inf)
    meter.record_eval({"tau": 1.6, "lossless": True, "tokens": 8})
    meter.close()
    step, ev = (json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert step["loss"] is None
    assert ev["kind"] == "eval" and ev["step"] == 1 and ev["tau"] == 1.6 and ev["lossless"] is True


def test_start_record_carries_the_config_and_stays_out_of_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    meter, _, _ = meter_for(tmp_path, total=1, every=1, tensorboard=True)
    meter.record_start({"train": {"steps": 1}}, start_step=0)
    meter.close()
    (start,) = (json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert start["kind"] == "start" and start["config"] == {"train": {"steps": 1}}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == []


def test_metrics_go_to_the_run_folder_when_dflashctl_launched_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_RUN_DIR", raising=False)
    assert metrics_dir(tmp_path / "out") == tmp_path / "out"
    monkeypatch.setenv("DFLASH_RUN_DIR", str(tmp_path / "runs" / "r1"))
    assert metrics_dir(tmp_path / "out") == tmp_path / "runs" / "r1"


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    meter, _, _ = meter_for(tmp_path, total=20, every=10, tensorboard=True)
    meter.start()
    for step in range(1, 21):
        add(meter, step, loss=3.0 - step / 10)
    meter.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [10, 20]
    assert [round(e.value, 3) for e in loss] == [2.45, 1.45]
    assert "train/acc_per_slot/2" in events.Tags()["scalars"]


def test_tensorboard_without_the_package_is_a_config_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(TrainConfigError, match=r"logging\.tensorboard: true needs the tensorboard"):
        load_train_config(None, ["logging.tensorboard=true"])
    assert load_train_config(None, ["logging.tensorboard=false"]).logging.tensorboard is False


def test_tau_is_the_serving_estimate_and_the_walk_is_recorded_beside_it(tmp_path):
    meter, log, writer = meter_for(tmp_path, every=5)
    assert [step for step in range(1, 11) if meter.due(step)] == [5, 10]
    for step in range(1, 6):
        add(meter, step, acc=0.9)  # the anchors' mean acceptance: 1.9, no serving estimate
    for step in range(6, 11):
        # (tokens, blocks) of each step's anchors as serving walks them: 0.4, 0.6 and
        # 0.5 blocks a token, pooled over the window: tau~ 1 / 0.5
        meter.add(
            step, loss=2.0, tokens=1, metrics={}, tau=1.9, lr=1e-3, queue_depth=0,
            queue_size=8, serving_estimate=(1.0, {6: 0.4, 7: 0.4, 8: 0.6, 9: 0.6}.get(step, 0.5)),
            serving_tau=1.25 if step == 10 else None,
        )  # fmt: skip
    writer.close()
    first, second = (
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    )
    assert (first["tau"], first["tau_anchors"], first["tau_walk"]) == (
        pytest.approx(1.9),
        pytest.approx(1.9),
        None,
    )
    assert (second["tau"], second["tau_anchors"], second["tau_walk"]) == (
        pytest.approx(2.0),
        pytest.approx(1.9),
        1.25,
    )
    step_line = next(line for line in log.lines if line.startswith("step 10/"))
    assert "| tau~ 2.00 |" in step_line
    assert any(line.startswith("tau walk | step 10 | tau 1.25 (tau~ 2.00)") for line in log.lines)


def test_the_exact_walk_is_due_only_within_its_share_of_the_training_time():
    from dflash.pipeline.meter import MeasurementBudget

    clock = Clock()
    budget = MeasurementBudget(0.01, clock)
    assert not budget.due()  # training has not begun
    budget.start()
    assert budget.due()  # the first one at once: its cost is not known yet
    budget.record(2.0)
    clock.now += 399.0  # 1% of 399 s is less than what it took plus the same again
    assert not budget.due()
    clock.now += 1.0
    assert budget.due()
    budget.record(2.0)
    assert budget.share() == pytest.approx(4.0 / 400.0)
    assert not MeasurementBudget(0.0, clock).due()  # 0: never
