"""Threads: warm-up gate, serial warm-up, back-pressure, failure propagation, schedules."""

from __future__ import annotations

import re
import threading
import time

import pytest

from tests.pipeline_standin import StandInLoss, StandInWorkload, run_standin


class Recording(StandInWorkload):
    """Records when batches are made and when drafters warm up / train."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.lock = threading.Lock()
        self.events: list[tuple[float, str, int]] = []
        self.consumed = 0
        self.max_lead = 0

    def note(self, what, value=0):
        with self.lock:
            self.events.append((time.monotonic(), what, value))

    def batch_for(self, step, shard, num_shards):
        self.note("batch", step)
        with self.lock:
            self.max_lead = max(self.max_lead, step - self.consumed)
        return super().batch_for(step, shard, num_shards)

    def example_inputs(self, device):
        self.note("warm-start")
        time.sleep(0.2)
        inputs = super().example_inputs(device)
        self.note("warm-end")
        return inputs


class SlowLoss(StandInLoss):
    workload: Recording

    def forward(self, *args):
        time.sleep(0.01)
        with self.workload.lock:
            self.workload.consumed += 1
        return super().forward(*args)


class SlowDrafters(Recording):
    def loss_module(self, drafter):
        module = SlowLoss(drafter)
        module.workload = self
        return module


def test_nothing_runs_before_every_drafter_is_warm_and_warm_ups_are_serial(tmp_path):
    holder = {}

    class Workload(Recording):
        def __init__(self, cfg):
            super().__init__(cfg)
            holder["w"] = self

    result, log = run_standin(
        tmp_path,
        Workload,
        runtime={"drafter_devices": ["cpu", "cpu", "cpu"]},
        train={"steps": 4, "log_every": 1},
    )
    assert result.exit_code == 0
    events = holder["w"].events
    warm = [(t, what) for t, what, _ in events if what.startswith("warm")]
    assert [what for _, what in warm] == ["warm-start", "warm-end"] * 3  # one drafter at a time
    last_warm = max(t for t, what in warm)
    first_batch = min(t for t, what, _ in events if what == "batch")
    assert first_batch > last_warm
    stages = [line for line in log.lines if " on cpu: " in line]
    warm_ups, after_gate = stages[:6], stages[6:]
    # Each drafter's warm-up is one uninterrupted pair of lines (the capture lock).
    names = []
    for warming, ready in zip(warm_ups[::2], warm_ups[1::2], strict=False):
        name = warming.split(" on ")[0]
        assert warming == f"{name} on cpu: warming up"  # eager
        assert re.fullmatch(rf"{name} on cpu: ready \(warm-up \d+\.\d s\)", ready)
        names.append(name)
    assert sorted(names) == ["drafter-0", "drafter-1", "drafter-2"]
    # Once the gate opens every thread names its new stage, so a failure in a step is
    # reported in that stage rather than in "ready".
    assert sorted(after_gate) == [
        "drafter-0 on cpu: training",
        "drafter-1 on cpu: training",
        "drafter-2 on cpu: training",
        "target-0 on cpu: running target forwards",
    ]


def test_bounded_queues_hold_the_prefetcher_back(tmp_path):
    holder = {}

    class Workload(SlowDrafters):
        def __init__(self, cfg):
            super().__init__(cfg)
            holder["w"] = self

    result, _ = run_standin(
        tmp_path,
        Workload,
        runtime={"queue_size": 2, "warmup_iters": 0},
        train={"steps": 40, "log_every": 10},
    )
    assert result.exit_code == 0
    # batch queue (2) + target loop in hand (1) + drafter queue (2) + drafter in hand (1)
    assert holder["w"].max_lead <= 6


def test_queue_depth_in_the_step_line(tmp_path):
    result, log = run_standin(
        tmp_path, runtime={"queue_size": 3}, train={"steps": 10, "log_every": 5}
    )
    steps = [line for line in log.lines if line.startswith("step ")]
    assert len(steps) == 2
    assert re.fullmatch(
        r"step 5/10 \| loss \d+\.\d{4} \| acc \d\.\d\d \| tau~ \d\.\d\d \| lr \d\.\de-\d+ \| grad_norm \S+ \| \d+ tok/s \| "
        r"mfu n/a \| queue [0-3]/3 \| eta \d+s",
        steps[0],
    )


@pytest.mark.parametrize(
    "fail_in, devices",
    [
        ("prefetcher@step:3", ["cpu"]),
        ("prefetcher@start", ["cpu", "cpu"]),
        ("target-0@step:2", ["cpu", "cpu"]),
        ("drafter-0@step:4", ["cpu"]),
        ("drafter-1@step:4", ["cpu", "cpu"]),
        ("drafter-0@warmup", ["cpu"]),
        ("drafter-1@warmup", ["cpu", "cpu"]),
    ],
)
def test_a_failing_thread_ends_the_run_with_its_traceback(tmp_path, fail_in, devices):
    result, log = run_standin(
        tmp_path,
        runtime={"drafter_devices": devices, "queue_size": 2},
        train={"steps": 50},
        debug={"fail_in": fail_in},
    )
    assert result.exit_code == 1
    assert not result.stuck_threads
    thread = fail_in.split("@")[0]
    first = log.lines.index(f"{thread} failed:")
    assert log.lines[first + 1] == "Traceback (most recent call last):"
    assert any(
        "InjectedFailure: injected failure in " + thread in line for line in log.lines[first:]
    )
    assert not any(line == "training complete" for line in log.lines)
    assert result.completed_steps < 50
    if "@step" in fail_in and thread != "prefetcher":
        # The stage the crash detector reports: the thread's last stage line.
        stages = [line for line in log.lines[:first] if line.startswith(f"{thread} on cpu: ")]
        expected = "training" if thread.startswith("drafter") else "running target forwards"
        assert stages[-1] == f"{thread} on cpu: {expected}"


def test_sequential_schedule_trains_the_same_as_pipelined(tmp_path):
    piped, _ = run_standin(tmp_path / "a", train={"steps": 12, "log_every": 4})
    seq, log = run_standin(
        tmp_path / "b", runtime={"schedule": "sequential"}, train={"steps": 12, "log_every": 4}
    )
    assert seq.exit_code == 0 and "training complete" in log.lines
    assert seq.history == piped.history


def test_nonfinite_losses_are_reported_and_skipped(tmp_path):
    result, log = run_standin(
        tmp_path,
        train={"steps": 8, "log_every": 1, "max_nonfinite": 2},
        debug={"nonfinite_at_steps": [3, 5]},
    )
    assert result.exit_code == 0
    assert "step 3/8 | loss nan | non-finite loss (1/2 allowed)" in log.lines
    assert "step 5/8 | loss nan | non-finite loss (2/2 allowed)" in log.lines
    assert [s for s, _ in result.history] == [1, 2, 4, 6, 7, 8]


def test_too_many_nonfinite_losses_stop_the_run(tmp_path):
    result, log = run_standin(
        tmp_path,
        runtime={"drafter_devices": ["cpu", "cpu"]},
        train={"steps": 20, "log_every": 1, "max_nonfinite": 1},
        debug={"nonfinite_at_steps": [2, 3]},
    )
    assert result.exit_code == 1
    assert "drafter-0 failed:" in log.lines
    assert any("NonFiniteLoss: 2 non-finite losses" in line for line in log.lines)
    assert result.completed_steps == 3
