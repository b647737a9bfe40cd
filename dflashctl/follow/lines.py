"""Log lines out of bytes (with the offset to resume from), printed and fed to the crash
detector."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from dflashctl.agent.supervisor import CRASHED, NEW_ATTEMPT, NOT_RETRIED

# At import, not when the first line comes: a follower is stopped by Ctrl-C, which must
# not land inside an import (one that did ended the CLI by the signal, exit -2, after it
# had said "interrupted").
from dflashctl.crash.detector import CrashDetector
from dflashctl.runs.summary import RunSummary

if TYPE_CHECKING:
    from dflashctl.crash import CrashEvent


def _line_style(line: str) -> str | None:
    lowered = line.lower()
    if line.startswith("Traceback") or " failed:" in line or "error" in lowered:
        return "red"
    if "warning" in lowered or "non-finite" in lowered:
        return "yellow"
    return None


# The trainer's header prints its resolved config, one line per key (some fifty), before
# the first step; a followed run shows one line for it instead.
TRAINER_HEADER = "dflash trainer: "
CONFIG_BLOCK = "config:"
CONFIG_COLLAPSED = (
    "config: (its lines are in train.log; `dflashctl runs show` shows the run's settings)"
)


class LineSink:
    """Prints log lines and feeds them to the crash detector, rendering each crash panel
    as soon as the detector is sure of it.

    With `keep_last` set, lines are held back (the backlog) until `go_live()`: then only
    the last `keep_last` of them are printed, followed by panels for crashes found in
    all of them, so `-n 50` still reports a crash from line 3.
    """

    def __init__(
        self,
        rules: Any,
        console: Console,
        *,
        keep_last: int | None = None,
        show_lines: bool = True,
        on_crash: Callable[[CrashEvent], None] | None = None,
        on_line: Callable[[str, bool], None] | None = None,
        node: str | None = None,
        collapse_config: bool = False,
    ) -> None:
        self.rules = rules
        # The trainer's resolved config in one line (following: deploy, restart, logs -f).
        self.collapse_config = collapse_config
        self._in_header = False
        self._in_config = False
        self.node = node  # the node this log is from: every crash in it names it
        self.detector = CrashDetector(rules, node=node)
        # Crashes of earlier attempts the run's supervisor recovered from (run.retry).
        self.recovered: list[CrashEvent] = []
        self.attempt = 1
        self.not_retried: str | None = None  # why the supervisor let the run end
        self._attempt_exit: int | None = None  # how the last attempt ended
        # The last attempt crashed and the supervisor is about to restart it.
        self.restarting = False
        self.summary = RunSummary()
        self.console = console
        self.show_lines = show_lines
        # on_crash sees each crash before it is rendered (it may relabel it: a failure
        # another node caused is a consequence there); on_line(text, live) sees each line.
        self.on_crash = on_crash
        self.on_line = on_line
        self.backlog: deque[str] | None = deque(maxlen=keep_last) if keep_last is not None else None
        self._held_events: list[CrashEvent] = []
        self.count = 0
        self._flushed_at = 0

    def line(self, text: str) -> None:
        self.count += 1
        if text.startswith("dflashctl: attempt "):
            if NEW_ATTEMPT.match(text):
                self._new_attempt(int(NEW_ATTEMPT.match(text)[1]))
            elif CRASHED.match(text):
                self._attempt_exit = int(CRASHED.match(text)[1])
                if NOT_RETRIED.match(text):
                    self.not_retried = NOT_RETRIED.match(text)[1]
                else:
                    self.restarting = True
        events = self.detector.feed(text)
        self.summary.feed(text)
        if self.on_line is not None:
            self.on_line(text, self.backlog is None)
        self._found(events, text)

    def quiet(self) -> None:
        """The log went quiet: a traceback that may still continue is final after all
        (the detector otherwise waits a few lines for a chained traceback)."""
        if self.backlog is None and self.count != self._flushed_at:
            self._flushed_at = self.count
            self._found(self.detector.flush())

    def go_live(self) -> None:
        if self.backlog is None:
            return
        # Taken first: a Ctrl-C while these print must not print them again (the
        # follower goes live once more on its way out).
        backlog, self.backlog = self.backlog, None
        for text in backlog:
            self._print(text)
        self._render(self._held_events)
        self._held_events = []

    def finish(self, exit_code: int | None) -> None:
        """The run ended: weigh the exit code (a crash may only now be certain)."""
        self.go_live()
        self._found(self.detector.finish(exit_code))

    def _new_attempt(self, number: int) -> None:
        """The supervisor restarted the trainer: what the last attempt died of is
        settled (shown, and kept as recovered); the new attempt's crashes are its own."""
        self._found(self.detector.finish(self._attempt_exit))
        self._attempt_exit = None
        self.recovered.extend(self.detector.crashes)
        self.detector = CrashDetector(self.rules, node=self.node)
        self.attempt = number
        self.restarting = False

    @property
    def crashes(self) -> list[CrashEvent]:
        """The crashes of the run's last attempt (the one that decides how it ended)."""
        return list(self.detector.crashes)

    @property
    def stop(self) -> dict[str, Any] | None:
        """How a stop the trainer was asked for went (crash/stops.py), if it was."""
        stop = self.detector.stop
        return stop.to_json() if stop is not None else None

    def _found(self, events: list[CrashEvent], text: str | None = None) -> None:
        """Tell on_crash of new crashes, then show them after the line they came with
        (`text`), or hold both back with the backlog."""
        if self.on_crash is not None:
            for event in events:
                self.on_crash(event)
        if self.backlog is not None:
            if text is not None:
                self.backlog.append(text)
            self._held_events.extend(events)
        else:
            if text is not None:
                self._print(text)
            self._render(events)

    def _print(self, text: str) -> None:
        if self.collapse_config:
            text = self._collapsed(text)
        if self.show_lines and text is not None:
            self.console.print(Text(text, style=_line_style(text) or ""), soft_wrap=True)

    def _collapsed(self, text: str) -> str | None:
        """The line to print in place of `text` (None: nothing): the config block of the
        trainer's header becomes one line; the crash detector still saw every line."""
        if self._in_config:
            if text.startswith("  "):
                return None
            self._in_config = False
        if text.startswith(TRAINER_HEADER):
            self._in_header = True
        elif self._in_header and text == CONFIG_BLOCK:
            self._in_header, self._in_config = False, True
            return CONFIG_COLLAPSED
        return text

    def _render(self, events: Iterable[CrashEvent]) -> None:
        if not self.show_lines:
            return
        from dflashctl.crash.render import render_crash

        for event in events:
            render_crash(self.console, event)


class LineSplitter:
    """Cuts a byte stream into lines and remembers the file offset just past the last
    complete line: the place to resume from after a drop."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset
        self._partial = bytearray()

    @property
    def received_end(self) -> int:
        """Offset just past the last byte received (complete line or not)."""
        return self.offset + len(self._partial)

    def reset(self, offset: int) -> None:
        self.offset = offset
        self._partial.clear()

    def feed(self, data: bytes) -> list[str]:
        self._partial += data
        lines = []
        start = 0
        while (end := self._partial.find(b"\n", start)) >= 0:
            lines.append(_decode(self._partial[start:end]))
            start = end + 1
        if start:
            del self._partial[:start]
            self.offset += start
        return lines

    def flush(self) -> str | None:
        """The last line of a log that does not end with a newline (the run is over)."""
        if not self._partial:
            return None
        text = _decode(self._partial)
        self.offset += len(self._partial)
        self._partial.clear()
        return text


def _decode(raw: bytes | bytearray) -> str:
    return bytes(raw).decode("utf-8", errors="replace").rstrip("\r")
