"""train.budget_minutes and data.fit: one recipe sized to a time budget and fitted to the data."""

from __future__ import annotations

import io
import json
import time
import types

import dflash.budget as budget
import pytest
import torch
from dflash.budget import (
    BudgetCheck,
    fit_anchors,
    fit_seq_len,
    many_epochs_warning,
    measure_step_seconds,
    steps_for_budget,
)
from dflash.dflash_workload import DFlashWorkload
from dflash.pipeline.logging import RunLog
from dflash.pipeline.optim import CosineWithWarmup
from dflash.pipeline.run import train
from dflash.pipeline.train_config import TrainConfigError, config_from_dict


def test_the_step_count_follows_the_budget_and_the_step_time():
    # 10 minutes, 15% kept for evals and the checkpoint, 30 s already spent: 480 s of steps.
    assert steps_for_budget(600, 0.1, spent_s=30) == 4800
    assert steps_for_budget(600, 0.2, spent_s=30) == 2400  # slower steps: fewer of them
    assert steps_for_budget(1200, 0.1, spent_s=30) == 9900  # twice the budget: more
    assert steps_for_budget(60, 100.0) == 1  # a budget below one step still trains one
    with pytest.raises(ValueError, match="step time"):
        steps_for_budget(60, 0.0)


def test_budget_minutes_must_be_positive():
    assert config_from_dict({"train": {"budget_minutes": 3}}).train.budget_minutes == 3
    with pytest.raises(TrainConfigError, match="train.budget_minutes"):
        config_from_dict({"train": {"budget_minutes": 0}})


def tiny_config(tmp_path, **train):
    return config_from_dict(
        {
            "output_dir": str(tmp_path / "out"),
            "target": {"preset": "tiny", "init_std": 0.03},
            "drafter": {"num_layers": 1, "block_size": 4, "gamma": 4.0},
            "data": {"num_samples": 16, "seq_len": 24, "batch_size": 2, "num_anchors": 2},
            "train": {"steps": 500, "log_every": 5, "tau_walk_rows": 0, **train},
            "runtime": {"compile": "eager", "threads": 2, "warmup_iters": 1},
            "eval": {"enabled": False},
        }
    )


def test_a_budgeted_run_takes_the_steps_its_budget_holds(tmp_path, monkeypatch):
    # The probe's step time and the clock are injected: the count is the budget's, not
    # this machine's speed (2 s a step, 9 s spent on set-up, 1 minute: 51 s - 9 s = 21 steps).
    monkeypatch.setattr(budget, "measure_step_seconds", lambda *args, **kw: 2.0)
    monkeypatch.setattr(budget, "time", types.SimpleNamespace(perf_counter=lambda: 1000.0))
    cfg = tiny_config(tmp_path, budget_minutes=1, epochs=50)
    workload = DFlashWorkload(cfg)
    workload.created = 991.0
    log = RunLog(io.StringIO())
    result = train(cfg, workload, log, handle_signals=False)
    assert result.exit_code == 0
    assert any("train.budget_minutes 1: 21 steps at 2000 ms a step" in x for x in log.lines)
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert steps[-1]["step"] == 21 and steps[-1]["total_steps"] == 21
    # 21 steps x 2 rows over 16 samples: 2.6 epochs, nothing to warn about.
    assert not any("by heart" in x for x in log.lines)


def test_a_budget_far_past_the_data_is_a_warning_that_says_what_to_do(tmp_path, monkeypatch):
    # 0.1 s a step for a minute over 16 samples, 2 a step: about 60 epochs.
    monkeypatch.setattr(budget, "measure_step_seconds", lambda *args, **kw: 0.1)
    monkeypatch.setattr(budget, "time", types.SimpleNamespace(perf_counter=lambda: 1000.0))
    cfg = tiny_config(tmp_path, budget_minutes=1)
    workload = DFlashWorkload(cfg)
    workload.created = 1000.0
    lines = []
    budget.size_to_budget(cfg, workload, 1, 1, lines.append)
    assert cfg.train.steps == 510
    warned = [x for x in lines if x.startswith("warning:")]
    assert len(warned) == 1 and "64 epochs of only 16 samples" in warned[0]
    assert "regenerate answers for more prompts" in warned[0]
    assert many_epochs_warning(20, 500) is None and many_epochs_warning(20.5, 500)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_check_resizes_from_the_rate_of_real_steps():
    # The probe said 10 ms a step: 1000 steps for the 10 s left. Training steps take 30 ms.
    clock = FakeClock()
    check = BudgetCheck(110.0, 0, 1000, queue_size=4, probe_s=0.01, clock=clock)
    assert (check.first, check.decide_at, check.active) == (5, 55, True)  # 5% of 1000 steps
    for step in range(1, 56):
        clock.now += 0.03
        if step == 30:  # a 0.5 s serving walk inside the timed steps is not a step's cost
            clock.now += 0.5
        new_total = check.timed(step, walk_s=0.5 if step >= 30 else 0.0)
        assert (new_total is None) == (step < 55)
    # at step 55: 110 - (100 + 55 x 0.03 + 0.5) = 7.85 s left, 261 steps of 30 ms
    assert new_total == 55 + 261 and round(check.step_ms) == 30
    assert check.applies_after(56) and not check.applies_after(55)
    assert "steps 1000 -> 316: training steps take 30 ms (the probe timed 10 ms alone)" in (
        check.line(1000)
    )
    # Past the deadline already: two more steps, never zero.
    late = BudgetCheck(100.0, 0, 1000, queue_size=4, clock=clock)
    late.timed(5)
    clock.now += 5
    assert late.timed(late.decide_at) == late.decide_at + 2


def test_the_budget_check_stays_off_where_the_loops_may_have_ended():
    # The prefetcher runs up to 2 x queue + 2 steps ahead: a run too short to re-size
    # before it could have produced its last batch keeps the probe's count.
    assert not BudgetCheck(0.0, 0, 40, queue_size=4).active
    assert BudgetCheck(0.0, 0, 60, queue_size=4).active
    resumed = BudgetCheck(0.0, 500, 1000, queue_size=4)  # timed from the resumed step
    assert (resumed.first, resumed.decide_at) == (505, 530)


def test_a_resumed_run_keeps_what_was_left_of_its_budget():
    # Resumed at step 500 of the probe's 1000 (10 ms a step): 470 steps x 10 ms = 4.7 s
    # were still planned, not a whole new budget; at 30 ms a step that is 156 more.
    clock = FakeClock()
    check = BudgetCheck(clock.now + 600, 500, 1000, queue_size=4, probe_s=0.01, clock=clock)
    check.timed(505)
    clock.now += 25 * 0.03
    assert check.timed(530) == 530 + 156


def test_a_resized_schedule_ends_its_cosine_at_the_new_count():
    schedule = CosineWithWarmup(1.0, 1000, warmup_ratio=0.04, min_lr_ratio=0.1)
    schedule.last_step = 20  # in the 40-step warm-up
    schedule.resize(300)
    assert schedule.warmup_steps == 21  # the ramp follows the new count (4% of 300 is 12)
    assert schedule.lr_at(299) == pytest.approx(0.1, rel=1e-3) and schedule.lr_at(300) == 0.1
    late = CosineWithWarmup(1.0, 1000, warmup_ratio=0.04, min_lr_ratio=0.1)
    late.last_step = 100  # past the warm-up: never back into one
    late.resize(3000)
    assert late.warmup_steps == 40 and late.lr_at(3000) == pytest.approx(0.1)


def test_a_run_whose_steps_are_slower_than_the_probe_ends_with_its_budget(tmp_path, monkeypatch):
    # The probe claims 5 ms a step, far below what a step takes here: the count it gives
    # would run past the budget. Two replicas (threads) take the new count at one step.
    monkeypatch.setattr(budget, "measure_step_seconds", lambda *args, **kw: 0.005)
    torch.set_num_threads(1)
    cfg = tiny_config(tmp_path, budget_minutes=0.1)
    cfg.runtime.drafter_devices = ["cpu", "cpu"]
    cfg.optim.min_lr_ratio = 0.1
    workload = DFlashWorkload(cfg)
    # The budget counts from here: a slow machine's set-up cannot eat it before the probe
    # (5.1 s of steps: about 1,000 at the probe's 5 ms).
    workload.created = time.perf_counter()
    log = RunLog(io.StringIO())
    result = train(cfg, workload, log, handle_signals=False)
    assert result.exit_code == 0
    sized = next(x for x in log.lines if x.startswith("train.budget_minutes 0.1:"))
    probed = int(sized.split(": ")[1].split(" steps")[0])
    resized = [x for x in log.lines if " -> " in x and x.startswith("train.budget_minutes:")]
    assert len(resized) == 1, log.lines
    new_total = int(resized[0].split(" -> ")[1].split(":")[0])
    assert new_total < probed
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert steps[-1]["step"] == new_total == steps[-1]["total_steps"] == result.completed_steps
    # the last step's learning rate is the cosine's floor: the schedule ended with the steps
    assert steps[-1]["lr"] == pytest.approx(cfg.optim.lr * cfg.optim.min_lr_ratio, rel=0.02)
    first, second = (r.model.state_dict() for r in result.replicas)
    assert all(torch.equal(first[k], second[k]) for k in first)  # still one model


def test_the_probe_times_real_training_steps(tmp_path):
    torch.set_num_threads(2)
    workload = DFlashWorkload(tiny_config(tmp_path))
    assert measure_step_seconds(workload, torch.device("cpu"), torch.device("cpu"), steps=1) > 0


def test_fitting_shapes_to_the_data():
    assert fit_seq_len([30, 41, 17], ceiling=3072, block=16) == 48  # longest, whole blocks
    assert fit_seq_len([5000], ceiling=3072, block=16) == 3072  # the ceiling holds
    assert fit_seq_len([3], ceiling=3072, block=16) == 32  # two blocks at least
    assert fit_anchors([160] * 10, wanted=512, block=16) == 10  # 512 cannot fit: 10 do
    assert fit_anchors([16000] * 10, wanted=512, block=16) == 512  # what was asked fits


def test_data_fit_shapes_the_run_to_its_file_and_warns(tmp_path):
    words = "numbers and lists and a short answer about them"
    records = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": " ".join([words] * (1 + i % 3))},
            ]
        }
        for i in range(12)
    ]
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = {"source": str(source), "seq_len": 512, "num_anchors": 64, "batch_size": 2}
    cfg = {
        "target": {"preset": "tiny"},
        "drafter": {"num_layers": 1, "block_size": 4},
        "eval": {"enabled": False},
    }
    plain = DFlashWorkload(config_from_dict({**cfg, "data": data}))
    assert (plain.seq_len, plain.num_anchors) == (512, 64)  # fit off: as configured
    fitted = DFlashWorkload(config_from_dict({**cfg, "data": {**data, "fit": True}}))
    longest = max(len(s.input_ids) for s in fitted.samples)
    assert fitted.seq_len == -(-longest // 4) * 4 < 512
    assert 1 <= fitted.num_anchors < 64
    notes = "\n".join(fitted.describe())
    assert "warning: data.num_anchors 64 cannot fit this data" in notes
    assert f"data.fit: seq_len {fitted.seq_len} (ceiling 512)" in notes
