"""The trainer's stack dumps: its watchdog's clock (no dump before the first step, one
per silence, none after the last step), a request answered with named threads, and
debug.hang_in checked like debug.fail_in."""

from __future__ import annotations

import io
import json
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

from dflash.pipeline.logging import RunLog  # noqa: E402
from dflash.pipeline.stacks import StackWatch, thread_stacks  # noqa: E402


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def watch(tmp_path, **kwargs):
    clock = Clock()
    log = RunLog(io.StringIO())
    made = StackWatch(tmp_path, 0, log, factor=4, min_s=10, clock=clock, **kwargs)
    made.folder.mkdir(parents=True)
    return made, clock, log


def test_the_watchdog_dumps_once_per_silence_and_never_before_the_first_step(tmp_path):
    made, clock, log = watch(tmp_path)
    clock.now = 10_000  # a long compile: nothing is judged yet
    assert made.check_watchdog() is None
    for step in range(1, 5):
        clock.now += 1
        made.step_done(step, 100)
    clock.now += 9
    assert made.check_watchdog() is None
    clock.now += 2
    path = made.check_watchdog()
    assert path == tmp_path / "stacks" / "rank0.watchdog.json"
    record = json.loads(path.read_text())
    assert (record["reason"], record["last_step"], record["rank"]) == ("watchdog", 4, 0)
    assert "MainThread" in {t["name"] for t in record["threads"]}
    assert log.lines[-1].startswith("watchdog: no step finished for 11 s (threshold 10 s)")
    clock.now += 100
    assert made.check_watchdog() is None  # once per silence
    made.step_done(5, 100)
    clock.now += 11
    assert made.check_watchdog() is not None  # a new silence


def test_past_the_last_step_is_no_hang(tmp_path):
    made, clock, _ = watch(tmp_path)
    for step in (1, 2):
        clock.now += 1
        made.step_done(step, 2)
    clock.now += 1000  # evaluation, the final checkpoint
    assert made.check_watchdog() is None


def test_threads_are_named_with_their_frames():
    ready, release = threading.Event(), threading.Event()

    def parked_here():
        ready.set()
        release.wait()

    worker = threading.Thread(target=parked_here, name="drafter-7")
    worker.start()
    ready.wait()
    try:
        threads = {t["name"]: t for t in thread_stacks()}
    finally:
        release.set()
        worker.join()
    assert [f["function"] for f in threads["drafter-7"]["frames"]][-3:-1] == ["parked_here", "wait"]


@pytest.mark.parametrize("value", ["drafter-0", "drafter-0@soon"])
def test_debug_hang_in_is_checked(value):
    from dflash.pipeline.train_config import TrainConfig

    with pytest.raises(Exception) as caught:
        TrainConfig.model_validate({"debug": {"hang_in": value}})
    assert "debug.hang_in" in str(caught.value) or "hang_in" in str(caught.value)
