"""Is a running run still making progress? Judged from its step lines' times.

A run hangs when no step line came for `factor` times its own recent interval between
step lines (the median of the last few, so one slow window does not move it), and at
least `min_s`. The clock starts at the first step line: compilation and warm-up before
it never count. A run whose last step line is its last step (evaluation, the final
checkpoint) expects no more and is never hanging.

The same judgement serves the agent (the times of metrics.jsonl's step records, for
`status` and `runs`) and the follower (the times step lines reached it, for `logs -f`).
Standard library only, Python 3.6 (the agent's floor).
"""

import json
import os
import re

DEFAULT_FACTOR = 4.0
DEFAULT_MIN_S = 60.0
# Intervals the median is taken over: recent enough to follow a slowdown.
RECENT_INTERVALS = 8
# metrics.jsonl is read from its end only: enough for the recent step records.
TAIL_BYTES = 64 << 10

# `step 120/10000 | loss ...` (also `[rank0]:step ...` under torchrun).
STEP_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?step (\d+)/(\d+) \| loss ")


def median(values):
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return None
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


class StepClock:
    """The times of a run's step lines, and the judgement on them."""

    def __init__(self, factor=DEFAULT_FACTOR, min_s=DEFAULT_MIN_S):
        self.factor = float(factor)
        self.min_s = float(min_s)
        self.restart()

    def restart(self):
        """A new attempt (a resume): its warm-up is not a gap between steps."""
        self.times = []  # of the recent step lines (at most RECENT_INTERVALS + 1)
        self.step = self.total = None

    def step_line(self, at, step, total):
        self.times.append(float(at))
        del self.times[: -(RECENT_INTERVALS + 1)]
        self.step, self.total = step, total

    def interval_s(self):
        times = self.times
        gaps = [times[i] - times[i - 1] for i in range(1, len(times)) if times[i] >= times[i - 1]]
        return median(gaps)

    def threshold_s(self):
        interval = self.interval_s()
        if interval is None:
            # One step line so far: its interval is unknown; the floor alone, doubled,
            # so a slow second window after the warm-up is no alarm.
            return 2 * self.min_s
        return max(self.min_s, self.factor * interval)

    def judge(self, now):
        """{"hanging", "last_step", "total_steps", "silent_s", "interval_s",
        "threshold_s"}; None before the first step line (nothing to judge yet)."""
        if not self.times:
            return None
        silent = max(0.0, now - self.times[-1])
        threshold = self.threshold_s()
        interval = self.interval_s()
        finishing = self.total is not None and self.step is not None and self.step >= self.total
        return {
            "hanging": bool(silent > threshold and not finishing),
            "last_step": self.step,
            "total_steps": self.total,
            "silent_s": round(silent, 1),
            "interval_s": None if interval is None else round(interval, 3),
            "threshold_s": round(threshold, 1),
        }


def describe(progress):
    """`hanging: no step line for 3m12s (step 1200/5000; threshold 60 s, 4x its 7.5 s
    interval)`, or None when the run is not hanging."""
    if not progress or not progress.get("hanging"):
        return None
    interval = progress.get("interval_s")
    basis = "the floor" if interval is None else f"its {interval:g} s step interval"
    return "hanging: no step line for {} (after step {}/{}; threshold {:g} s from {})".format(
        duration(progress["silent_s"]),
        progress.get("last_step"),
        progress.get("total_steps"),
        progress["threshold_s"],
        basis,
    )


def duration(seconds):
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def metrics_progress(run_dir, factor, min_s, now, attempt_started=None):
    """The judgement from run_dir/metrics.jsonl's step records (their `time`, written by
    the trainer with the clock of this machine); None without any. `attempt_started`:
    when the attempt now running began (the supervisor's restart): the clock starts
    again there, so an earlier attempt's last step is no hang of this one's start-up."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - TAIL_BYTES))
            if size > TAIL_BYTES:
                f.readline()  # a cut line
            raw = f.read()
    except OSError:
        return None
    clock = StepClock(factor, min_s)
    for line in raw.splitlines():
        try:
            record = json.loads(line.decode("utf-8"))
        except ValueError:
            continue  # a line still being written
        if not isinstance(record, dict):
            continue
        kind, at = record.get("kind"), record.get("time")
        if kind == "start":
            clock.restart()
        elif kind == "step" and isinstance(at, (int, float)):
            clock.step_line(at, record.get("step"), record.get("total_steps"))
    if attempt_started is not None and clock.times and clock.times[-1] < attempt_started:
        clock.restart()
    return clock.judge(now)


def hang_settings(meta):
    """The run's thresholds, recorded in its meta.json at launch (run.hang)."""
    hang = meta.get("hang") if isinstance(meta, dict) else None
    hang = hang if isinstance(hang, dict) else {}
    factor = hang.get("factor", DEFAULT_FACTOR)
    min_s = hang.get("min_s", DEFAULT_MIN_S)
    if not isinstance(factor, (int, float)) or factor <= 0:
        factor = DEFAULT_FACTOR
    if not isinstance(min_s, (int, float)) or min_s < 0:
        min_s = DEFAULT_MIN_S
    return float(factor), float(min_s)


# The trainer's watchdog line (trainer/dflash/pipeline/stacks.py) and a step line.
_WATCHDOG_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?watchdog: (no step finished for .*?)(?:; every thread's stack.*)?$"
)


def hang_at_stop(run_dir, factor, min_s, now):
    """What the run's hang was when a stop came, or None when it was not hanging: the
    agent's judgement from metrics.jsonl, else the trainer's watchdog line in the log
    with no step line after it. Recorded with the stop, so that a run stopped while it
    hung keeps `hung` as its end state."""
    progress = metrics_progress(run_dir, factor, min_s, now)
    if progress and progress.get("hanging"):
        return describe(progress)
    try:
        with open(os.path.join(run_dir, "train.log"), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - TAIL_BYTES))
            tail = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    said = None
    for line in tail:
        if STEP_LINE.match(line):
            said = None  # the steps came again after it
            continue
        found = _WATCHDOG_LINE.match(line) if "watchdog: " in line else None
        if found:
            said = found.group(1)
    return said


def first_start_step(run_dir, max_lines=50):
    """The step the trainer's first start record (metrics.jsonl, `{"kind": "start",
    "step"}`) says the run began at: 0 for a new training, else the step it continued
    from; None before the trainer wrote one (or for a trainer that writes none)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), "rb") as f:
            for _ in range(max_lines):
                raw = f.readline()
                if not raw:
                    return None
                try:
                    record = json.loads(raw.decode("utf-8"))
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("kind") == "start":
                    step = record.get("step")
                    return step if isinstance(step, int) else None
    except OSError:
        return None
    return None
