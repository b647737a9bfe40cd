"""torchrun's own word on a failed job (torch.distributed.elastic), read from the log.

    E1130 20:50:42.344000 27594 torch/.../api.py:1002] failed (exitcode: -9) local_rank: 0 (pid: 27599) of binary: ...
    torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
    ============================================================
    train.py FAILED
    ------------------------------------------------------------
    Failures:
    [1]:
      time      : 2026-11-30_20:50:42
      host      : gpu-b
      rank      : 0 (local_rank: 0)
      exitcode  : 1 (pid: 27598)
      error_file: /tmp/torchelastic_x/none_y/attempt_0/0/error.json
      traceback : Traceback (most recent call last):
          File "train.py", line 9, in main
        RuntimeError: boom
    ------------------------------------------------------------
    Root Cause (first observed failure):
    [0]:
      time      : 2026-11-30_20:50:42
      host      : gpu-b
      rank      : 1 (local_rank: 1)
      exitcode  : -9 (pid: 27599)  (SIGKILL)
      error_file: <N/A>
      traceback : Signal 9 (SIGKILL) received by PID 27599
    ============================================================

The table lists every failed rank; "Root Cause" the first one (torch 1.9 to 2.x write it
alike; "<NO_OTHER_FAILURES>" when there is only one). With the entry point under
torchelastic's `record`, the traceback is the rank's own (its error file), indented two
more spaces; else "To enable traceback see: ..." or the signal. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

ROOT_CAUSE_HEADER = "Root Cause (first observed failure):"
_FIELD = re.compile(r"^\s+(time|host|rank|exitcode|error_file|traceback)\s*:\s?(.*?)\s*$")
_RANK = re.compile(r"^(\d+) \(local_rank: (\d+)\)")
_EXIT = re.compile(r"^(-?\d+) \(pid: (\d+)\)")
_ENTRY = re.compile(r"^\[\d+\]:\s*$")
# The line torchrun logs first, before its ChildFailedError and summary: glog style
# (`E1130 20:50:42.344000 27594 torch/.../api.py:1002] failed ...`, torch >= 2.2) or
# logging's (`ERROR:torch.distributed.elastic.multiprocessing.api:failed ...`).
_FAILED_LINE = re.compile(r"\bfailed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
# The signal as a number or as an enum member, by torch version: `SIGTERM`, `15`,
# `Signals.SIGTERM`.
_CLOSING = re.compile(r"[\]:] ?Sending process \d+ closing signal (?:Signals\.)?SIG\w+")
_TOLD_TO_STOP = re.compile(
    r"[\]:] ?Received (?:Signals\.)?(\w+) death signal, shutting down workers"
)
_SIGNAL_TEXT = re.compile(r"^Signal (\d+) \((SIG\w+)\) received by PID \d+")
_NO_TRACEBACK = ("<N/A>", "To enable traceback")


@dataclass
class TorchrunFailure:
    """One failed rank as torchrun's summary describes it."""

    rank: int | None = None
    local_rank: int | None = None
    exitcode: int | None = None  # negative: killed by that signal
    pid: int | None = None
    time: str | None = None  # as torchrun wrote it (the node's local clock)
    host: str | None = None
    error_file: str | None = None
    traceback: str | None = None  # first line; the rank's own when its entry is recorded
    traceback_lines: list[str] = field(default_factory=list)  # all of it, de-indented
    line: int = 0  # the log line of its entry

    @property
    def signal(self) -> int | None:
        return -self.exitcode if self.exitcode is not None and self.exitcode < 0 else None

    @property
    def has_traceback(self) -> bool:
        return bool(self.traceback) and not self.traceback.startswith(_NO_TRACEBACK)

    def describe(self) -> str:
        """`exit code -9 (SIGKILL), pid 27599`."""
        parts = []
        if self.signal is not None:
            parts.append(f"killed by {signal_name(self.signal)}")
        elif self.exitcode is not None:
            parts.append(f"exit code {self.exitcode}")
        if self.pid is not None:
            parts.append(f"pid {self.pid}")
        return ", ".join(parts)

    def to_json(self) -> dict:
        """Its fields up to the traceback's first line (the whole of it stays here)."""
        return {k: v for k, v in asdict(self).items() if k not in ("traceback_lines", "line")}


def _signal_number(text: str) -> int:
    import signal

    if text.isdigit():
        return int(text)
    try:
        return int(signal.Signals[text])
    except KeyError:
        return 0


def signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class TorchrunWatch:
    """Reads a node's log lines for torchrun's failure summary; keeps the root cause
    (`failure`) and every failed rank (`failures`), and notes the moment torchrun starts
    stopping the other local ranks after a failure (`rank_failed`) or was told to stop."""

    def __init__(self) -> None:
        self.failure: TorchrunFailure | None = None  # the root cause (or the first sign)
        self.failures: list[TorchrunFailure] = []
        self.rank_failed = False
        self.told_to_stop: int | None = None  # the signal torchrun received
        self.done = False  # the summary ended ("=====" after the root cause)
        self.line_no = 0
        self._section: str | None = None  # None | "failures" | "root"
        self._entry: TorchrunFailure | None = None
        self._in_traceback = False

    @property
    def in_summary(self) -> bool:
        return self._section is not None

    def feed(self, line: str) -> None:
        self.line_no += 1
        told = _TOLD_TO_STOP.search(line) if "Received " in line else None
        if told:
            self.told_to_stop = _signal_number(told[1])
        elif "Sending process " in line and self.told_to_stop is None and _CLOSING.search(line):
            self.rank_failed = True
        if self.done:
            return
        if self._section is None:
            if line.startswith("Failures:"):
                self._section = "failures"
            elif line.startswith(ROOT_CAUSE_HEADER):
                self._section = "root"
            elif "failed (exitcode: " in line and _FAILED_LINE.search(line):
                failed = _FAILED_LINE.search(line)
                first = self.failure or TorchrunFailure(line=self.line_no)
                first.exitcode = int(failed[1])
                first.local_rank, first.pid = int(failed[2]), int(failed[3])
                self.failure = first
            return
        self._summary_line(line)

    def _summary_line(self, line: str) -> None:
        if line.startswith(("=====", "-----")):
            self._in_traceback = False
            self.done = self._section == "root" and self._entry is not None
            if self.done:
                self._section = None
            elif line.startswith("-----"):
                self._section = "failures"
            return
        if line.startswith(ROOT_CAUSE_HEADER):
            self._section, self._in_traceback = "root", False
            return
        if _ENTRY.match(line):
            self._in_traceback = False
            self._entry = TorchrunFailure(line=self.line_no)
            if self._section == "root":
                # The "failed (exitcode...)" line came first: the entry says more.
                self.failure = self._entry
            else:
                self.failures.append(self._entry)
            return
        entry = self._entry
        if entry is None:
            return
        found = _FIELD.match(line)
        if found and not (self._in_traceback and line.startswith("    ")):
            self._in_traceback = False
            key, value = found.groups()
            rank, code = _RANK.match(value), _EXIT.match(value)
            if key == "rank" and rank:
                entry.rank, entry.local_rank = int(rank[1]), int(rank[2])
            elif key == "exitcode" and code:
                entry.exitcode, entry.pid = int(code[1]), int(code[2])
            elif key in ("time", "host"):
                setattr(entry, key, value)
            elif key == "error_file":
                entry.error_file = None if value == "<N/A>" else value
            elif key == "traceback":
                entry.traceback = value
                entry.traceback_lines = [value]
                self._in_traceback = True
            return
        if self._in_traceback:
            # The recorded traceback goes on, two spaces deeper than its own indentation.
            entry.traceback_lines.append(line[2:] if line.startswith("  ") else line)

    def signal_of_root(self) -> int | None:
        failure = self.failure
        if failure is None:
            return None
        if failure.signal is not None:
            return failure.signal
        said = _SIGNAL_TEXT.match(failure.traceback or "")
        return int(said[1]) if said else None
