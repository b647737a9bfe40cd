"""A streaming crash detector: feed it a run's log line by line, get CrashEvents.

Python tracebacks are grouped into one event even when other threads keep printing in
between: the lines of a traceback have a fixed shape (indented `File ...` frames and
code, then the unindented `Type: message` line), and a line that does not fit that shape
belongs to somebody else and is handled as an ordinary line. A traceback belongs to the
thread announced just before it ("drafter-2 failed:" or "Exception in thread X:"); the
thread's device and stage come from its last "drafter-2 on cuda:7: <stage>" line.

Lines outside tracebacks are matched against the one-line rules (NCCL watchdog, kernel
OOM killer, segfault, ...). Most lines match nothing, so every line first passes one
compiled keyword gate built from the rules' keywords (text every line a rule matches
contains, stated in the rule); only a hit runs the regexes of the rules that keyword
belongs to. Rules without keywords are tried on every line.

Each line's rank comes from its `[rankN]:` prefix or the trainer's `distributed:` lines
(ranks.py); torchrun's summary (torchrun.py) names the rank that failed first and how.
The root cause is chosen in ordering.py: not simply the first failure in the log, since
the rank that notices another's death often speaks first.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dflashctl.crash import endings
from dflashctl.crash.culprit import rank_and_blame
from dflashctl.crash.events import CrashEvent
from dflashctl.crash.facts import add_facts
from dflashctl.crash.gate import keyword_gate
from dflashctl.crash.hangs import HangLines
from dflashctl.crash.ordering import training_failed
from dflashctl.crash.ranks import RankBook, split_prefix
from dflashctl.crash.rules import Rule
from dflashctl.crash.stops import StopWatch
from dflashctl.crash.torchrun import TorchrunWatch
from dflashctl.crash.trace_parts import (
    MAX_EXCERPT,
    TAIL_REACH,
    Segment,
    Trace,
    classify_trace,
    is_class_name,
    is_code_line,
    last_redraw,
    looks_like_exception,
    short_path,
    trim_excerpt,
)

TRACEBACK_HEADER = "Traceback (most recent call last):"
_CHAIN_MARKERS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
# "in <func>" is missing for a SyntaxError's frame.
_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<lineno>\d+)(?:, in (?P<func>.+?))?\s*$')
_EXCEPTION = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)(?::(?: (?P<msg>.*))?)?$")
_EXCEPTION_PREFIX = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*): (?P<msg>.*)$")
_STAGE = re.compile(
    r"^\s*(?P<thread>[A-Za-z][\w.-]*) on (?P<device>(?:cuda|cpu|mps|xpu|hpu|npu)(?::\d+)?): (?P<stage>.*\S)"
)
_ANNOUNCE_FAILED = re.compile(
    r"^(?P<thread>[A-Za-z][\w.-]*) failed(?: \(after an earlier failure\))?:\s*$"
)
# CPython's header; " failed" at its end: another thread's "X failed:" header written
# into it when two threads failed at once (a real, garbled log).
_ANNOUNCE_THREAD = re.compile(r"^Exception in thread (?P<thread>.+?)(?: failed)?:\s*$")
# CPython reports exceptions it swallowed (in __del__, at exit) this way; the run goes on.
_IGNORED = "Exception ignored"
# The fixed lines PyTorch appends to a CUDA error's message.
_CONTINUATION = re.compile(
    r"^(CUDA kernel errors might be asynchronously reported|For debugging consider passing "
    r"CUDA_LAUNCH_BLOCKING|Compile with `TORCH_USE_CUDA_DSA`|Device-side assertion tracking|"
    r"Search for `cuda\w+' in https://docs\.nvidia\.com)"
)
_STRUCTURAL_KEYWORDS = (
    TRACEBACK_HEADER,
    "Exception in thread ",
    " failed:",
    " failed (after an earlier failure):",
    _IGNORED,
)

# What torchrun itself prints before any rank runs: its banner, its glog-style lines.
_LAUNCHER_LINE = re.compile(r"^(\*{5,}|Setting OMP_NUM_THREADS|[IWEF]\d{4} \d\d:\d\d:\d\d)")
_STARTED = re.compile(r"^started (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC$")  # the trainer's header
ANNOUNCE_REACH = 8  # "X failed:" names a traceback starting within this many other lines
STALE_REACH = 200  # lines without a frame after which an unfinished traceback is given up
MERGE_WINDOW = 40  # one-line matches this close together with the same rule are one event
MAX_CONTINUATION = 4  # lines right after an exception line taken as its message's rest


@dataclass
class _Pending:
    """A one-line match held back briefly: repeats merge into it, a traceback may absorb it."""

    event: CrashEvent
    last_match: int
    after_left: int


class CrashDetector:
    """Feed lines with feed(); call finish() at the end of the run. See module doc."""

    def __init__(self, rules: Sequence[Rule], *, node: str | None = None) -> None:
        """`node`: the node this log is from (its name in dflash.yaml), when known."""
        self.rules = list(rules)
        self._trace_rules = [r for r in self.rules if r.scope != "line"]
        line_rules = [r for r in self.rules if r.scope != "traceback" and r.patterns]
        self._unkeyed_line_rules = [r for r in line_rules if r.keywords is None]
        self._keyed_line_rules = [r for r in line_rules if r.keywords is not None]
        keywords = set(_STRUCTURAL_KEYWORDS)
        for rule in self._keyed_line_rules:
            keywords.update(rule.keywords or ())
        self._gate = keyword_gate(keywords)
        self._events: list[CrashEvent] = []  # in log order
        self.line_no = 0
        # (rank, thread) -> (device, stage): threads of different ranks share names.
        self._threads: dict[tuple[int | None, str], tuple[str, str]] = {}
        # Headers ("drafter-2 failed:") waiting for their traceback, oldest first: two
        # threads failing at once print both headers before either traceback.
        # Each is (thread, header line, line number, self._ordinary_lines then, rank).
        self._announced: deque[tuple[str | None, str, int, int, int | None]] = deque()
        self.ranks = RankBook(node)
        self.torchrun = TorchrunWatch()
        self.stops = StopWatch()
        self.hangs = HangLines()
        # rank -> (thread, device, exception type, message) of "training failed: ..."
        self.named_failures: dict[int | None, tuple[str, str | None, str, str]] = {}
        self._ordinary_lines = 0  # lines that were not part of a traceback
        self._traces: list[Trace] = []
        self._pending: list[_Pending] = []
        self._recent: deque[str] = deque(maxlen=12)
        self._rank: int | None = None  # rank of the line being read
        self._local: int | None = None  # its local rank, when its prefix says
        self._finished = False
        self._outside_stop = False  # see stopped_from_outside
        self._error_files: list = []
        self.started_at: float | None = None  # the trainer's last "started ..." header line
        self.program_lines = 0  # lines not torchrun's own: 0, the program never spoke

    @property
    def crashes(self) -> list[CrashEvent]:
        """Every crash so far, the root cause first (see ordering.py), named after the
        rank that failed rather than the one that noticed (culprit.py)."""
        return rank_and_blame(self)

    @property
    def named_rank(self) -> int | None:
        """The rank torchrun's summary names as the first observed failure."""
        failure = self.torchrun.failure if self.torchrun.done else None
        return failure.rank if failure is not None else None

    @property
    def in_log_order(self) -> list[CrashEvent]:
        """The crashes so far in the order of the log (endings.py adds to them)."""
        return self._events

    def stopped_from_outside(self, killed: bool) -> None:
        """The run was stopped (dflashctl stop's record; call before finish): a SIGKILL
        at its end (`killed`, or bash's "Killed" line) is the stop's own after the grace
        period, not a crash, nor the OOM killer's doing."""
        self._outside_stop = True
        kills = [e for e in self._events if e.rule == "killed"]
        for event in kills:
            self._events.remove(event)
        if kills or killed:
            self._stop_killed()

    def _stop_killed(self) -> None:
        info = self.stops.info
        if not info.clean:
            info.killed_after_grace = True
            info.signal = info.signal or "SIGTERM"

    @property
    def stop(self):
        """How a stop went (stops.StopInfo), when the run was asked to stop."""
        info = self.stops.info
        return info if info.requested or info.clean or info.killed_after_grace else None

    # --- public API ---------------------------------------------------------------------

    def feed(self, line: str) -> list[CrashEvent]:
        """Take one log line; return the events that became certain with it."""
        self.line_no += 1
        line = line.rstrip("\n")
        if "\r" in line:  # progress bars redraw with \r: what is left visible counts
            line = last_redraw(line)
        # torchrun's ranks share one log; the trainer prefixes ranks other than 0 the way
        # torch does. Threads of different ranks have the same names: keep them apart.
        line, prefixed, local = split_prefix(line)
        self.ranks.feed(line, prefixed)
        self._rank = self.ranks.rank_of(prefixed, local)
        self._local = local  # torchrun --tee's [defaultN]: the local rank, rank or not
        self._recent.append(line)
        if line.strip() and not _LAUNCHER_LINE.match(line):
            self.program_lines += 1
        out: list[CrashEvent] = []
        self.stops.feed(line, self.line_no, torchrun_failing=self.torchrun.rank_failed)
        started = _STARTED.match(line) if line.startswith("started ") else None
        if started:
            self.started_at = endings.utc_seconds(started[1])
        was_done = self.torchrun.done
        self.torchrun.feed(line)
        if self.torchrun.in_summary or self.torchrun.done != was_done:
            if self.torchrun.done and not was_done:
                out += self.flush()  # tracebacks before the summary are complete
                for event in endings.torchrun_events(self):
                    self._emit(event, out)
            return out  # torchrun's summary: read above, its text matches no rule
        if (line.startswith(("watchdog: ", "threads still running ", "step "))) and self.hangs.feed(
            line, self._rank, self.line_no
        ):
            return out  # the trainer's word on a hang: weighed at the end (hangs.py)
        if self._traces and self._feed_traceback(line, out):
            return out
        self._ordinary_lines += 1
        if self._pending:
            self._feed_pending(line, out)
        gated = self._gate(line)
        after_header = bool(self._announced) and self._announced[-1][2] == self.line_no - 1
        if gated or self._unkeyed_line_rules or after_header:
            self._feed_candidate(line, out, gated=bool(gated))
        if line.startswith("training failed") and self._rank not in self.named_failures:
            named = training_failed(line)
            if named is not None:
                self.named_failures[self._rank] = named
        if " on " in line:  # after the rules: a crash line is not the stage it failed in
            stage = _STAGE.match(line)
            if stage:
                self._threads[(self._rank, stage["thread"])] = (stage["device"], stage["stage"])
        return out

    def flush(self) -> list[CrashEvent]:
        """Emit what is only waiting for more lines (call when the log has gone quiet)."""
        out: list[CrashEvent] = []
        for trace in [t for t in self._traces if t.state != "frames"]:
            self._close_trace(trace, out)
        self._flush_pending(out, before=None)
        return out

    def finish(self, exit_code: int | None = None) -> list[CrashEvent]:
        """The run ended: emit everything still open and weigh the exit status."""
        out: list[CrashEvent] = []
        if self._finished:
            return out
        self._finished = True
        for trace in sorted(self._traces, key=lambda t: t.start_line):
            self._close_trace(trace, out)
        self._flush_pending(out, before=None)
        for event in endings.hang_events(self):
            self._emit(event, out)
        for event in endings.error_file_events(self, self._error_files):
            self._emit(event, out)
        for event in endings.exit_code_events(self, exit_code):
            self._emit(event, out)
        return out

    def add_error_files(self, records: list) -> None:
        """torchelastic's error files of the run (crash/error_files.py), weighed at finish."""
        self._error_files.extend(records)

    # --- tracebacks ---------------------------------------------------------------------

    def _feed_traceback(self, line: str, out: list[CrashEvent]) -> bool:
        """Give the line to an open traceback; False when it is somebody else's line."""
        n = self.line_no
        if line.startswith(TRACEBACK_HEADER):
            chained = self._latest("chain")
            if chained is not None:
                chained.segments.append(Segment())
                chained.lines.append(line)
                chained.state = "frames"
                chained.end_line = n
                return True
            return False  # a new traceback: started by the ordinary path
        if not line.strip():
            for trace in self._traces:
                trace.continuation_left = 0  # a blank line ends a multi-line message
            return True
        if line in _CHAIN_MARKERS:
            trace = self._latest("tail")
            if trace is not None:
                trace.lines.append(line)
                trace.state = "chain"
                trace.tail_left = TAIL_REACH
                return True
            return False
        target = self._latest("frames")
        if target is not None:
            segment = target.segments[-1]
            if line[0] in " \t" and not (" on " in line and _STAGE.match(line)):
                frame = _FRAME.match(line)
                if frame:
                    segment.frames.append(
                        [short_path(frame["path"]), frame["lineno"], frame["func"], ""]
                    )
                elif segment.frames and not segment.frames[-1][3] and is_code_line(line):
                    segment.frames[-1][3] = line.strip()
                target.lines.append(line)
                target.end_line = n
                return True
            if segment.frames:
                exc = _EXCEPTION.match(line)
                # Right after the frames any class name will do; after another thread's
                # line only one that looks like an exception (not "Epoch: 3").
                adjacent = target.end_line == n - 1
                if exc and (
                    looks_like_exception(exc["type"]) or (adjacent and is_class_name(exc["type"]))
                ):
                    segment.exc_type = exc["type"]
                    segment.exc_message = (exc["msg"] or "").strip() or None
                    segment.exc_index = len(target.lines)
                    target.lines.append(line)
                    target.end_line = n
                    target.state = "tail"
                    target.tail_left = TAIL_REACH
                    # Only a message can go on over several lines; a bare exception ends here.
                    target.continuation_left = MAX_CONTINUATION if segment.exc_message else 0
                    return True
        # Somebody else's line. It may still continue a multi-line exception message.
        for trace in list(self._traces):
            if trace.state == "frames":
                if n - trace.end_line > STALE_REACH:
                    # Its exception line never came (a quoted header, a garbled print):
                    # report what there is rather than swallow indented lines forever.
                    self._traces.remove(trace)
                    if trace.segments[0].frames:
                        self._close_trace(trace, out)
                continue
            if trace.continuation_left and trace.state == "tail":
                segment = trace.segments[-1]
                first = trace.continuation_left == MAX_CONTINUATION
                if first and (segment.exc_message or "").endswith(":"):
                    # "backend='inductor' raised:" -- the inner error is on the next line
                    segment.exc_message = f"{segment.exc_message} {line.strip()}"
                    trace.lines.append(line)
                    trace.continuation_left -= 1
                elif _CONTINUATION.match(line):
                    trace.lines.append(line)
                    trace.continuation_left -= 1
                else:
                    trace.continuation_left = 0  # somebody else's line ends the message
            trace.tail_left -= 1
            if trace.tail_left <= 0:
                self._close_trace(trace, out)
        return False

    def _latest(self, state: str) -> Trace | None:
        return next((t for t in reversed(self._traces) if t.state == state), None)

    def _start_trace(self, line: str) -> None:
        announced = self._announced
        while announced and self._ordinary_lines - announced[0][3] > ANNOUNCE_REACH:
            announced.popleft()
        # The header of this rank's (a traceback of rank 1 is not rank 0's thread's).
        header_of = next((a for a in announced if a[4] == self._rank), None)
        if header_of is None:
            self._add_trace(None, None, self.line_no, line, Segment())
        else:
            announced.remove(header_of)
            thread, header, start, _, _ = header_of
            self._add_trace(thread, header, start, line, Segment())

    def _add_trace(
        self, thread: str | None, header: str | None, start: int, line: str, segment: Segment
    ) -> Trace:
        """A traceback of the line's rank from `line` on, after its thread's `header`."""
        # What the thread was doing when it failed, before it prints anything else.
        device, stage = self.thread_state(self._rank, thread or "")
        trace = Trace(
            thread=thread,
            start_line=start,
            lines=[line] if header is None else [header, line],
            segments=[segment],
            end_line=self.line_no,
            ignored=header is not None and header.startswith(_IGNORED),
            device=device,
            stage=stage,
            rank=self._rank,
            local_rank=self._local,
        )
        self._traces.append(trace)
        return trace

    def _close_trace(self, trace: Trace, out: list[CrashEvent]) -> None:
        if trace in self._traces:
            self._traces.remove(trace)
        if trace.ignored or endings.is_torchrun_summary(trace.segments[-1].exc_type):
            return  # torchrun's ChildFailedError: its summary is read line by line
        event = classify_trace(trace, self._trace_rules)
        if event is None:
            return
        # One-line matches of the same kind just before (kernel assertion lines before
        # "device-side assert triggered") are part of this failure, not another one.
        for pending in list(self._pending):
            same = pending.event.category == event.category
            if same and pending.last_match >= trace.start_line - MERGE_WINDOW:
                self._pending.remove(pending)
                if pending.event.line < event.line:
                    event.excerpt = pending.event.excerpt + event.excerpt
                    event.line = pending.event.line
                    event.thread = event.thread or pending.event.thread
                    event.device = event.device or pending.event.device
        self._flush_pending(out, before=event.line)
        event.excerpt = trim_excerpt(event.excerpt)
        self._emit(event, out)

    # --- ordinary lines -----------------------------------------------------------------

    def _feed_candidate(self, line: str, out: list[CrashEvent], *, gated: bool = True) -> None:
        """`gated`: the line holds one of the keywords (else only rules without any can
        match it)."""
        n = self.line_no
        if line.startswith(TRACEBACK_HEADER):
            self._start_trace(line)
            return
        announce = _ANNOUNCE_FAILED.match(line) or _ANNOUNCE_THREAD.match(line)
        if announce:
            self._announced.append((announce["thread"], line, n, self._ordinary_lines, self._rank))
            return
        if line.startswith(_IGNORED):
            self._announced.append((None, line, n, self._ordinary_lines, self._rank))
            return
        if self._announced and self._bare_exception(line):
            return
        for rule in self._keyed_line_rules if gated else ():
            if any(k in line for k in rule.keywords or ()) and rule.matches_line(line):
                self._one_line_match(rule, line, out)
                return
        for rule in self._unkeyed_line_rules:
            if rule.matches_line(line):
                self._one_line_match(rule, line, out)
                return

    def _bare_exception(self, line: str) -> bool:
        """A header right before an exception line without a traceback ("peers
        failed:" + the PeerFailure the trainer made itself): one failure, complete.
        Else the header would wait for the next traceback, perhaps torchrun's."""
        header_of = self._announced[-1]
        if header_of[2] != self.line_no - 1 or header_of[4] != self._rank:
            return False
        exc = _EXCEPTION_PREFIX.match(line) or _EXCEPTION.match(line)
        if exc is None or not looks_like_exception(exc["type"]):
            return False
        self._announced.pop()
        thread, header, start, _, _ = header_of
        message = (exc.groupdict().get("msg") or "").strip() or None
        segment = Segment(exc_type=exc["type"], exc_message=message, exc_index=1)
        self._add_trace(thread, header, start, line, segment).state = "tail"
        return True

    def _one_line_match(self, rule: Rule, line: str, out: list[CrashEvent]) -> None:
        n = self.line_no
        if rule.name == "killed" and self.stops.takes_kill():
            return  # the stop's own SIGKILL after its grace period (see stops.py)
        for pending in self._pending:
            if pending.event.category == rule.category:  # repeats, other ranks, echoes
                pending.last_match = n
                pending.event.end_line = n
                if len(pending.event.excerpt) < MAX_EXCERPT:
                    pending.event.excerpt.append(line)
                return
        for crash in reversed(self._events):
            if (
                crash.category == rule.category
                and crash.end_line >= n - MERGE_WINDOW
                and crash.rank == self._rank
            ):
                # The same failure told again (C++ `what():` after the Python traceback).
                crash.end_line = n
                if len(crash.excerpt) < MAX_EXCERPT:
                    crash.excerpt.append(line)
                return
        thread = device = stage = None
        staged = _STAGE.match(line)
        if staged:
            thread, device = staged["thread"], staged["device"]
            text = staged["stage"]
            stage = self._threads.get((self._rank, thread), (None, None))[1]
        else:
            text = line.strip()
        exc_type = None
        exc = _EXCEPTION_PREFIX.match(text)
        if exc and looks_like_exception(exc["type"]):
            exc_type, text = exc["type"], exc["msg"]
        event = CrashEvent.of_rule(
            rule,
            n,
            thread=thread,
            device=device,
            stage=stage,
            exception=exc_type,
            message=text,
            excerpt=[line],
            rank=self._rank,
            local_rank=self._local,
        )
        self._pending.append(_Pending(event=event, last_match=n, after_left=rule.excerpt_after))

    def _feed_pending(self, line: str, out: list[CrashEvent]) -> None:
        n = self.line_no
        for pending in self._pending:
            if pending.after_left > 0 and pending.last_match < n:
                pending.after_left -= 1
                pending.event.excerpt.append(line)
                pending.event.end_line = n
        # A failure seen earlier in an unfinished traceback must be reported first.
        oldest_trace = min((t.start_line for t in self._traces), default=n)
        expired = [
            p
            for p in self._pending
            if n - p.last_match > MERGE_WINDOW and p.event.line < oldest_trace
        ]
        for pending in expired:
            self._pending.remove(pending)
            self._emit(pending.event, out)

    def _flush_pending(self, out: list[CrashEvent], before: int | None) -> None:
        for pending in sorted(self._pending, key=lambda p: p.event.line):
            if before is None or pending.event.line < before:
                self._pending.remove(pending)
                self._emit(pending.event, out)

    # --- the end of the run -------------------------------------------------------------

    def recent_lines(self) -> list[str]:
        """The last lines read (an event without a traceback shows them)."""
        return list(self._recent)

    def thread_state(self, rank: int | None, thread: str) -> tuple[str | None, str | None]:
        """(device, stage) of a rank's thread, from its last "X on cuda:N: stage" line."""
        return self._threads.get((rank, thread), (None, None))

    def _emit(self, event: CrashEvent, out: list[CrashEvent]) -> None:
        if self.stops.is_echo(event):
            return  # the end of a job that stopped cleanly (stops.py)
        if self._outside_stop and event.rule == "killed":
            self._stop_killed()
            return
        self._place(event)
        add_facts(event, self.ranks.others(event.rank))
        index = len(self._events)
        while index > 0 and self._events[index - 1].line > event.line:
            index -= 1
        self._events.insert(index, event)
        self.crashes  # noqa: B018 - sets is_root_cause on every event, as ranked now
        out.append(event)

    def _place(self, event: CrashEvent) -> None:
        """The event's rank, local rank, node and host, from what the log said."""
        info = self.ranks.info(event.rank)
        if info is not None:
            event.fill_from(info)
        event.node = event.node or self.ranks.node_of(event.rank)


def classify_text(
    lines: Iterable[str], exit_code: int | None, rules: Sequence[Rule]
) -> list[CrashEvent]:
    """All crashes in a finished log, root cause first (for `dflashctl logs --file`)."""
    detector = CrashDetector(rules)
    for line in lines:
        detector.feed(line)
    detector.finish(exit_code)
    return detector.crashes
