"""While following a run: say when its step lines stop (the run hangs), and when they
come again. The times are those the step lines reached the follower, from the first
one that came live (a backlog arrives all at once); until then, the agent's judgement
from the run's metrics.jsonl (its record of the run, from the state polls) stands in,
so a run that already hangs when `logs -f` starts is named too."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from dflashctl.agent.progress import (
    DEFAULT_FACTOR,
    DEFAULT_MIN_S,
    STEP_LINE,
    StepClock,
    describe,
)

CHECK_EVERY_S = 0.5
# trainer/dflash/pipeline/stacks.py's line, with the prefix torchrun's ranks may carry.
WATCHDOG_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?watchdog: (?P<said>no step finished for (?P<silent>\d+) s .*?"
    r"\(threshold (?P<threshold>\d+) s\)[^;]*)"
)


class HangWatch:
    def __init__(
        self,
        factor: float = DEFAULT_FACTOR,
        min_s: float = DEFAULT_MIN_S,
        *,
        progress_of: Callable[[], dict[str, Any] | None] | None = None,
        announce: Callable[[str, dict[str, Any]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.steps = StepClock(factor, min_s)
        self.progress_of = progress_of
        self.announce = announce
        self.clock = clock
        self.hanging: dict[str, Any] | None = None  # the judgement while it hangs
        self._from_watchdog = False  # `hanging` came from the trainer's watchdog line
        self._next_check = 0.0
        # A restarted attempt seen: until its first step line, nothing is a hang (the
        # agent's view may still count from the last attempt's steps).
        self._starting_again = False

    def line(self, text: str, live: bool) -> None:
        if text.startswith("dflashctl: attempt "):
            self.steps.restart()  # a restarted attempt warms up again
            self.hanging = None
            self._from_watchdog = False
            self._starting_again = live
            return
        watchdog = WATCHDOG_LINE.match(text) if live and "watchdog: " in text else None
        if watchdog is not None:
            # The trainer's own watchdog: also before the first step line (a start-up
            # that deadlocked, a rank waiting at the rendezvous), which the step clock
            # cannot judge.
            first = self.hanging is None
            self._from_watchdog = True  # stands until a step line comes (see check)
            self.hanging = {
                "hanging": True,
                "last_step": self.steps.step,
                "total_steps": self.steps.total,
                "silent_s": float(watchdog["silent"]),
                "interval_s": None,
                "threshold_s": float(watchdog["threshold"]),
                "said": watchdog["said"],
            }
            if first and self.announce is not None:
                self.announce("hanging", self.hanging)
            return
        m = STEP_LINE.match(text)
        if m is None or not live:
            return
        self.steps.step_line(self.clock(), int(m[1]), int(m[2]))
        self._from_watchdog = False
        self._starting_again = False
        if self.hanging is not None:
            was, self.hanging = self.hanging, None
            if self.announce is not None:
                self.announce("progress", dict(was, last_step=int(m[1])))

    def check(self) -> dict[str, Any] | None:
        """Judge now (at most every CHECK_EVERY_S); announce a new hang once."""
        now = self.clock()
        if now < self._next_check:
            return self.hanging
        self._next_check = now + CHECK_EVERY_S
        if self._from_watchdog and self.hanging is not None:
            return self.hanging  # the trainer's own word: until its steps come again
        judged = self.steps.judge(now)
        if judged is None and self.progress_of is not None and not self._starting_again:
            judged = self.progress_of()  # no live step line yet: the agent's view
        if judged and judged.get("hanging"):
            first = self.hanging is None
            self.hanging = judged
            if first and self.announce is not None:
                self.announce("hanging", judged)
        elif judged is not None and self.hanging is not None:
            self.hanging = None
        return self.hanging

    def final(self) -> dict[str, Any] | None:
        """When following ends: the hang seen live, else the agent's latest judgement."""
        if self.hanging is not None:
            return self.hanging
        judged = self.progress_of() if self.progress_of is not None else None
        return judged if judged and judged.get("hanging") else None


def describe_hang(progress: dict[str, Any]) -> str:
    if progress.get("said"):  # the trainer's watchdog said it, in its own words
        return f"hanging: {progress['said']}"
    return describe(progress) or "hanging"
