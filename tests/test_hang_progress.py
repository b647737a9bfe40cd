"""When a running run is said to hang: the step clock shared by the agent (metrics.jsonl)
and the follower (step lines as they come), and run.hang's checks."""

from __future__ import annotations

import json

import pytest

from dflashctl.agent.progress import StepClock, describe, hang_settings, metrics_progress
from dflashctl.follow.hangs import HangWatch


def clock_with(times, factor=4.0, min_s=60.0, total=1000):
    clock = StepClock(factor, min_s)
    for i, at in enumerate(times, start=1):
        clock.step_line(at, 10 * i, total)
    return clock


def test_nothing_is_judged_before_the_first_step_line():
    # Minutes of compilation and warm-up before it never count.
    assert StepClock().judge(now=10_000.0) is None


def test_a_hang_is_k_times_the_recent_interval_with_a_floor():
    steady = clock_with([0, 30, 60, 90])  # a step line every 30 s: threshold 4 x 30 = 120 s
    assert steady.threshold_s() == 120
    assert steady.judge(90 + 119)["hanging"] is False
    judged = steady.judge(90 + 121)
    assert judged["hanging"] is True
    assert (judged["last_step"], judged["interval_s"], judged["threshold_s"]) == (40, 30, 120)
    fast = clock_with([0, 1, 2, 3])  # 1 s apart: the floor (60 s) decides
    assert fast.threshold_s() == 60
    assert fast.judge(3 + 59)["hanging"] is False and fast.judge(3 + 61)["hanging"] is True


def test_one_slow_window_does_not_move_the_median():
    clock = clock_with([0, 10, 20, 30, 40, 140, 150, 160])  # one 100 s window (a checkpoint)
    assert clock.interval_s() == 10


def test_a_single_step_line_waits_twice_the_floor():
    clock = clock_with([500.0])
    assert clock.judge(500 + 119)["hanging"] is False
    assert clock.judge(500 + 121)["hanging"] is True


def test_the_last_step_is_never_a_hang():
    # After the last step line the run evaluates and writes its final checkpoint.
    clock = clock_with([0, 1, 2, 3], total=40)
    assert clock.step == 40
    assert clock.judge(10_000)["hanging"] is False


def test_metrics_jsonl_step_records_and_a_restart(tmp_path):
    records = [
        {"kind": "start", "step": 0, "time": 100.0},
        {"kind": "step", "step": 10, "total_steps": 100, "time": 200.0},
        {"kind": "step", "step": 20, "total_steps": 100, "time": 210.0},
        {"kind": "start", "step": 20, "time": 1000.0},  # a restarted attempt
        {"kind": "step", "step": 30, "total_steps": 100, "time": 1300.0},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n" + '{"kind": "st')
    judged = metrics_progress(str(tmp_path), 4, 60, now=1300 + 100)
    # Only the new attempt's one step line counts (twice the floor), not the gap before it.
    assert judged["hanging"] is False and judged["last_step"] == 30
    assert metrics_progress(str(tmp_path), 4, 60, now=1300 + 121)["hanging"] is True
    assert metrics_progress(str(tmp_path / "none"), 4, 60, now=0) is None


def test_describe_says_how_long_and_against_what():
    judged = clock_with([0, 30, 60]).judge(60 + 200)
    assert describe(judged) == (
        "hanging: no step line for 3m20s (after step 30/1000; threshold 120 s from its "
        "30 s step interval)"
    )
    assert describe(clock_with([0, 30]).judge(31)) is None


def test_hang_settings_come_from_the_runs_meta_with_defaults():
    assert hang_settings({"hang": {"factor": 3, "min_s": 5}}) == (3.0, 5.0)
    assert hang_settings({}) == (4.0, 60.0)
    assert hang_settings({"hang": {"factor": "x", "min_s": -1}}) == (4.0, 60.0)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_follower_times_live_lines_only_and_announces_once():
    said = []
    clock = FakeClock()
    watch = HangWatch(
        4, 10, announce=lambda kind, p: said.append((kind, p["last_step"])), clock=clock
    )
    # A backlog arrives at once: not timed.
    for step in (2, 4, 6):
        watch.line(f"step {step}/100 | loss 1.0 | acc 0.1", live=False)
    clock.now = 1000
    assert watch.check() is None
    for step in (8, 10, 12):
        clock.now += 1
        watch.line(f"[rank0]: step {step}/100 | loss 1.0 | acc 0.1", live=True)
    clock.now += 9
    assert watch.check() is None
    clock.now += 2
    assert watch.check()["hanging"] is True
    clock.now += 60
    watch.check()
    assert said == [("hanging", 12)]
    watch.line("step 14/100 | loss 1.0 | acc 0.1", live=True)
    assert said[-1] == ("progress", 14) and watch.hanging is None


def test_the_follower_takes_the_agents_judgement_before_a_live_step_line():
    progress = {
        "hanging": True,
        "last_step": 8,
        "total_steps": 100,
        "silent_s": 300.0,
        "interval_s": 2.0,
        "threshold_s": 60.0,
    }
    watch = HangWatch(progress_of=lambda: progress, clock=FakeClock())
    assert watch.check() == progress
    assert watch.final() == progress


@pytest.mark.parametrize(
    ("hang", "says"),
    [
        ({"factor": 1}, "run.hang.factor: must be more than 1"),
        ({"factor": ".nan"}, "run.hang.factor: expected a finite number"),
        ({"min_s": 0}, "run.hang.min_s: must be more than 0 seconds"),
        ({"min_s": "soon"}, "run.hang.min_s"),
        ({"after": 3}, "run.hang.after"),
    ],
)
def test_run_hang_is_checked_with_a_clear_error(tmp_path, hang, says):
    import yaml

    from dflashctl.config.schema import load_config
    from dflashctl.errors import DflashError

    path = tmp_path / "dflash.yaml"
    path.write_text(
        yaml.safe_dump({"host": {"address": "127.0.0.1"}, "container": {"vmid": 200}})
        + "run:\n  hang: {"
        + ", ".join(f"{k}: {v}" for k, v in hang.items())
        + "}\n"
    )
    with pytest.raises(DflashError) as caught:
        load_config(path)
    assert caught.value.exit_code == 2
    assert says in caught.value.message


def test_the_trainers_watchdog_line_names_a_hang_before_the_first_step_line():
    """A start-up that deadlocked (or a rank waiting at the rendezvous): no step line
    to time, but the trainer's watchdog says so, and the follower takes its word."""
    from dflashctl.follow.hangs import describe_hang

    said = []
    clock = FakeClock()
    watch = HangWatch(4, 5, announce=lambda kind, p: said.append(kind), clock=clock)
    watch.line("drafter-0 on cpu: warming up", live=True)
    clock.now = 500
    assert watch.check() is None  # nothing to judge yet
    watch.line(
        "[rank1]: watchdog: no step finished for 92 s after the start (threshold 90 s), before "
        "the first step; waiting: drafter-0 at entry.py:26 in warm; every thread's stack "
        "written to /r/stacks/rank1.watchdog.json",
        live=True,
    )
    clock.now += 1
    hanging = watch.check()
    assert hanging["hanging"] and hanging["silent_s"] == 92 and said == ["hanging"]
    assert describe_hang(hanging).startswith("hanging: no step finished for 92 s after the start")
    clock.now += 600
    assert watch.check() is hanging and watch.final() is hanging
    watch.line("step 5/100 | loss 1.0 | acc 0.1", live=True)
    assert watch.hanging is None and said[-1] == "progress"
