"""A run that was asked to stop and did so cleanly: not a crash.

The bundled trainer turns the first SIGTERM or SIGINT into "finish the step, write a
checkpoint, stop", and says so:

    received SIGTERM: finishing the current step, then writing a checkpoint
    stopped by SIGTERM after step 11/4000; a redeploy continues from it (checkpoint ...)
    stopped by SIGINT before the first step: nothing trained, no checkpoint written

After its stop line, what the end of the job prints is the stop's doing, not a failure:
torchrun's `SignalException: Process N got signal: 15` (it was signalled too, and exits
1), a second Ctrl-C's KeyboardInterrupt, exit status 130 or 143. A stop that ran past its
grace period ends in SIGKILL (`dflashctl stop`, docker, Kubernetes and systemd all do
this): that is said as such, not as a crash. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dflashctl.crash.events import CrashEvent

_REQUESTED = re.compile(
    r"^received (?P<signal>SIG[A-Z]+): finishing the current step, then writing a checkpoint"
)
_STOPPED = re.compile(
    r"^stopped by (?P<why>.+?) after step (?P<step>\d+)(?:/\d+)?; .*\(checkpoint (?P<ckpt>.+)\)\s*$"
)
_STOPPED_EARLY = re.compile(
    r"^stopped (?:by (?P<why>.+?) )?before (?:the first step|training started): nothing trained"
)
# What the end of a stopped job prints, beside its own stop line.
_STOP_ECHO_EXCEPTIONS = ("KeyboardInterrupt", "SignalException", "ChildFailedError")
STOP_SIGNALS = (2, 15)  # SIGINT, SIGTERM


@dataclass
class StopInfo:
    requested_line: int | None = None  # "received SIGTERM ..." (the first)
    signal: str | None = None
    line: int | None = None  # the stop line
    step: int | None = None  # the checkpoint's step; None: stopped before any step
    checkpoint: str | None = None
    clean: bool = False
    killed_after_grace: bool = False  # asked to stop, then SIGKILLed before it could

    @property
    def requested(self) -> bool:
        return self.requested_line is not None

    def outcome(self) -> str:
        """`checkpoint at step 11`: what the stop left."""
        if self.clean and self.step is not None:
            return f"checkpoint at step {self.step}"
        if self.clean:
            return "before the first step: nothing trained, no checkpoint written"
        if self.killed_after_grace:
            return (
                "killed by SIGKILL when the stop's grace period ran out, before it wrote a "
                "checkpoint; a redeploy continues from the last one"
            )
        return "asked to stop"

    def describe(self) -> str:
        """`stopped (checkpoint at step 11)`."""
        if self.clean or self.killed_after_grace:
            return f"stopped ({self.outcome()})"
        return "asked to stop"

    def to_json(self) -> dict[str, Any]:
        return {
            "signal": self.signal,
            "step": self.step,
            "checkpoint": self.checkpoint,
            "clean": self.clean,
            "killed_after_grace": self.killed_after_grace,
            "line": self.line,
            "requested_line": self.requested_line,
            "said": self.describe(),
            "outcome": self.outcome(),
        }


class StopWatch:
    def __init__(self) -> None:
        self.info = StopInfo()

    def feed(self, line: str, line_no: int, *, torchrun_failing: bool = False) -> None:
        """`torchrun_failing`: torchrun is stopping the ranks because one failed (its
        SIGTERM is then no stop from outside)."""
        if not (line.startswith("received ") or line.startswith("stopped ")):
            return
        info = self.info
        requested = _REQUESTED.match(line)
        if requested:
            if info.requested_line is None and not torchrun_failing:
                info.requested_line, info.signal = line_no, requested["signal"]
            return
        if info.clean:
            return  # every rank says it: the first is the one
        stopped = _STOPPED.match(line)
        if stopped:
            info.clean, info.line = True, line_no
            info.step, info.checkpoint = int(stopped["step"]), stopped["ckpt"]
            return
        if _STOPPED_EARLY.match(line):
            info.clean, info.line = True, line_no

    def is_echo(self, event: CrashEvent) -> bool:
        """After a clean stop: this event is the end of the stopped job, not a failure."""
        info = self.info
        if not info.clean or info.line is None or event.line < info.line:
            return False
        if event.category in ("terminated", "exit_status", "killed"):
            return True
        return (event.exception or "").endswith(_STOP_ECHO_EXCEPTIONS)

    def takes_kill(self) -> bool:
        """A SIGKILL now ends a stop that ran past its grace period."""
        info = self.info
        if info.requested and not info.clean:
            info.killed_after_grace = True
            return True
        return info.clean
