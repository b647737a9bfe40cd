"""A hang told after the fact: the trainer's own watchdog and stop lines, read from the log.

A run that hangs prints nothing about itself, except what the trainer's watchdog says
(trainer/dflash/pipeline/stacks.py) when no step finished for its threshold, or when
the first step has not come long after the start:

    watchdog: no step finished for 12 s (threshold 5 s) after step 10; waiting: drafter-0 at entry.py:14 in push; every thread's stack written to ...
    watchdog: no step finished for 52 s after the start (threshold 50 s), before the first step; ...

and, when a stop then finds a thread that never ends:

    threads still running 8 s after the stop: drafter-0; exiting

A step line after a watchdog line means the run went on: no hang. One still open when
the log ends is a hang (the rank, the thread, how long it was silent), whatever ended
the run afterwards (a stop's SIGKILL after its grace, a peer's collective timing out).
Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_WATCHDOG = re.compile(
    r"^watchdog: no step finished for (?P<silent>\d+) s "
    r"(?:\(threshold (?P<threshold>\d+) s\) after step (?P<step>\d+|\?)"
    r"|after the start \(threshold (?P<start_threshold>\d+) s\), before the first step)"
    r"(?:; waiting: (?P<waiting>.*?))?(?:; every thread's stack written to (?P<path>\S+))?\s*$"
)
_STUCK = re.compile(r"^threads still running (?P<grace>\d+) s after the stop: (?P<threads>[^;]+)")
_STEP = re.compile(r"^step \d+/\d+ \| ")
_THREAD = re.compile(r"^(?P<name>[\w.-]+) at (?P<where>\S+ in \S+)")


@dataclass
class Silence:
    """One rank's hang as its log tells it."""

    rank: int | None
    line: int
    silent_s: float | None = None
    threshold_s: float | None = None
    last_step: int | None = None  # None: before the first step
    before_first_step: bool = False
    threads: list[str] = field(default_factory=list)  # the stuck ones, the first the likeliest
    waiting: dict[str, str] = field(default_factory=dict)  # thread -> "file:line in function"
    stacks_file: str | None = None
    said: list[str] = field(default_factory=list)  # the lines that told it

    def where(self) -> str:
        """`after step 10`, `before the first step`."""
        if self.before_first_step:
            return "before the first step"
        return f"after step {self.last_step}" if self.last_step is not None else "before the stop"

    def message(self) -> str:
        where = self.where()
        how_long = f" for {self.silent_s:.0f} s" if self.silent_s is not None else ""
        text = f"no step finished{how_long} {where}"
        if self.threads:
            text += f"; {self.threads[0]} stuck"
            if self.waiting_at:
                text += f" at {self.waiting_at}"
        return text

    @property
    def waiting_at(self) -> str | None:
        """Where the likeliest stuck thread stood when the watchdog looked."""
        return self.waiting.get(self.threads[0]) if self.threads else None

    def to_json(self) -> dict:
        return {
            "silent_rank": self.rank,
            "silent_s": self.silent_s,
            "threshold_s": self.threshold_s,
            "last_step": self.last_step,
            "before_first_step": self.before_first_step,
            "threads": list(self.threads),
            "waiting_at": self.waiting_at,
            "stacks_file": self.stacks_file,
        }


class HangLines:
    """Feed every line (without its rank prefix) with its rank; `open` at the end."""

    def __init__(self) -> None:
        self.silences: dict[int | None, Silence] = {}
        self.stepped = False  # a step line came: a silence after it is not start-up's

    def feed(self, line: str, rank: int | None, line_no: int) -> bool:
        """True when the line was the watchdog's or a stuck stop's (no rule needs it)."""
        if line.startswith("step ") and _STEP.match(line):
            self.silences.clear()  # the steps came again: every rank took part in them
            self.stepped = True
            return False
        found = _WATCHDOG.match(line)
        if found is not None:
            silence = self.silences.setdefault(rank, Silence(rank=rank, line=line_no))
            silence.silent_s = float(found["silent"])
            start = found["start_threshold"]
            silence.threshold_s = float(start or found["threshold"])
            silence.before_first_step = start is not None
            step = found["step"]
            silence.last_step = int(step) if step and step.isdigit() else None
            silence.stacks_file = found["path"]
            silence.said.append(line)
            for part in (found["waiting"] or "").split(", "):
                thread = _THREAD.match(part)
                if thread and thread["name"] not in silence.threads:
                    silence.threads.append(thread["name"])
                    silence.waiting[thread["name"]] = thread["where"]
            return True
        found = _STUCK.match(line)
        if found is not None:
            stuck = [name.strip() for name in found["threads"].split(",") if name.strip()]
            silence = self.silences.setdefault(
                rank, Silence(rank=rank, line=line_no, before_first_step=not self.stepped)
            )
            silence.said.append(line)
            # The stop names the threads that never ended: the stuck ones, first.
            silence.threads = stuck + [t for t in silence.threads if t not in stuck]
            return True
        return False

    @property
    def open(self) -> list[Silence]:
        """The hangs still open, earliest first."""
        return sorted(self.silences.values(), key=lambda s: s.line)
