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

The first failure is the root cause; the rest are consequences.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dflashctl.crash.events import CrashEvent
from dflashctl.crash.rules import Rule

TRACEBACK_HEADER = "Traceback (most recent call last):"
_CHAIN_MARKERS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
# "in <func>" is missing for a SyntaxError's frame.
_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<lineno>\d+)(?:, in (?P<func>.+?))?\s*$')
_EXCEPTION = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)(?::(?: (?P<msg>.*))?)?$")
_EXCEPTION_PREFIX = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*): (?P<msg>.*)$")
_EXCEPTION_SUFFIXES = (
    "Error",
    "Exception",
    "Exit",
    "Interrupt",
    "Failed",
    "Failure",
    "Unsupported",
    "Timeout",
    "Iteration",
    "Warning",
    "Abort",
    "Aborted",
    "Crash",
    "Crashed",
)
_STAGE = re.compile(
    r"^\s*(?P<thread>[A-Za-z][\w.-]*) on (?P<device>(?:cuda|cpu|mps|xpu|hpu|npu)(?::\d+)?): (?P<stage>.*\S)"
)
_ANNOUNCE_FAILED = re.compile(r"^(?P<thread>[A-Za-z][\w.-]*) failed:\s*$")
_ANNOUNCE_THREAD = re.compile(r"^Exception in thread (?P<thread>.+?):\s*$")
# CPython reports exceptions it swallowed (in __del__, at exit) this way; the run goes on.
_IGNORED = "Exception ignored"
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?")
_GPU_IN_MESSAGE = re.compile(r"\bGPU (\d+)\b|\bcuda:(\d+)\b")
_SITE_PACKAGES = re.compile(r"^.*[/\\](?:site|dist)-packages[/\\]")
# The fixed lines PyTorch appends to a CUDA error's message.
_CONTINUATION = re.compile(
    r"^(CUDA kernel errors might be asynchronously reported|For debugging consider passing "
    r"CUDA_LAUNCH_BLOCKING|Compile with `TORCH_USE_CUDA_DSA`|Device-side assertion tracking|"
    r"Search for `cuda\w+' in https://docs\.nvidia\.com)"
)
_STRUCTURAL_KEYWORDS = (TRACEBACK_HEADER, "Exception in thread ", " failed:", _IGNORED)

ANNOUNCE_REACH = 8  # "X failed:" names a traceback starting within this many other lines
TAIL_REACH = 6  # lines after an exception line in which a chained traceback may continue
STALE_REACH = 200  # lines without a frame after which an unfinished traceback is given up
MERGE_WINDOW = 40  # one-line matches this close together with the same rule are one event
MAX_EXCERPT = 60
MAX_CONTINUATION = 4  # lines right after an exception line taken as its message's rest

NONZERO_EXIT_HINT = (
    "The run exited with a non-zero status but printed no failure dflashctl recognises. "
    "Read the last lines of the log; add a rule to crash_patterns in dflash.yaml for this "
    "message so that it is named next time."
)


@dataclass
class _Segment:
    """One traceback of a chain: its frames and the exception that ended it."""

    frames: list[list] = field(default_factory=list)  # [path, lineno, func or None, code]
    exc_type: str | None = None
    exc_message: str | None = None
    exc_index: int = -1  # index in _Trace.lines of the exception line


@dataclass
class _Trace:
    thread: str | None
    start_line: int
    lines: list[str]
    segments: list[_Segment]
    state: str = "frames"  # frames -> tail (exception seen) -> chain (marker seen) -> frames
    tail_left: int = TAIL_REACH
    continuation_left: int = 0
    end_line: int = 0
    ignored: bool = False  # announced by "Exception ignored in ...": not a crash
    device: str | None = None  # the thread's, when its traceback started
    stage: str | None = None


@dataclass
class _Pending:
    """A one-line match held back briefly: repeats merge into it, a traceback may absorb it."""

    event: CrashEvent
    last_match: int
    after_left: int


class CrashDetector:
    """Feed lines with feed(); call finish() at the end of the run. See module doc."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = list(rules)
        self._trace_rules = [r for r in self.rules if r.scope != "line"]
        line_rules = [r for r in self.rules if r.scope != "traceback" and r.patterns]
        self._unkeyed_line_rules = [r for r in line_rules if r.keywords is None]
        self._keyed_line_rules = [r for r in line_rules if r.keywords is not None]
        keywords = set(_STRUCTURAL_KEYWORDS)
        for rule in self._keyed_line_rules:
            keywords.update(rule.keywords or ())
        self._gate = keyword_gate(keywords)
        self.crashes: list[CrashEvent] = []
        self.line_no = 0
        self._threads: dict[str, tuple[str, str]] = {}  # thread -> (device, stage)
        # Headers ("drafter-2 failed:") waiting for their traceback, oldest first: two
        # threads failing at once print both headers before either traceback.
        # Each is (thread, header line, line number, self._ordinary_lines then).
        self._announced: deque[tuple[str | None, str, int, int]] = deque()
        self._ordinary_lines = 0  # lines that were not part of a traceback
        self._traces: list[_Trace] = []
        self._pending: list[_Pending] = []
        self._recent: deque[str] = deque(maxlen=12)
        self._rank: str | None = None  # rank of the line being read (its [rankN]: prefix)
        self._finished = False

    # --- public API ---------------------------------------------------------------------

    def feed(self, line: str) -> list[CrashEvent]:
        """Take one log line; return the events that became certain with it."""
        self.line_no += 1
        line = line.rstrip("\n")
        if "\r" in line:  # progress bars redraw with \r: what is left visible counts
            line = _last_redraw(line)
        # torchrun's ranks share one log; the trainer prefixes ranks other than 0 the way
        # torch does. Threads of different ranks have the same names: keep them apart.
        self._rank = None
        if line.startswith("[rank"):
            prefix = _RANK_PREFIX.match(line)
            if prefix:
                self._rank = prefix.group(1) if prefix.group(1) != "0" else None
                line = line[prefix.end() :]
        self._recent.append(line)
        out: list[CrashEvent] = []
        if self._traces and self._feed_traceback(line, out):
            return out
        self._ordinary_lines += 1
        if self._pending:
            self._feed_pending(line, out)
        if self._gate(line) or self._unkeyed_line_rules:
            self._feed_candidate(line, out)
        if " on " in line:  # after the rules: a crash line is not the stage it failed in
            stage = _STAGE.match(line)
            if stage:
                self._threads[self._qualify(stage["thread"])] = (stage["device"], stage["stage"])
        return out

    def _qualify(self, thread: str) -> str:
        """``drafter-0 (rank 1)`` for a line of rank 1; unprefixed lines are rank 0's."""
        return f"{thread} (rank {self._rank})" if self._rank else thread

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
        for event in self._events_from_exit_code(exit_code):
            self._emit(event, out)
        return out

    # --- tracebacks ---------------------------------------------------------------------

    def _feed_traceback(self, line: str, out: list[CrashEvent]) -> bool:
        """Give the line to an open traceback; False when it is somebody else's line."""
        n = self.line_no
        if line.startswith(TRACEBACK_HEADER):
            chained = self._latest("chain")
            if chained is not None:
                chained.segments.append(_Segment())
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
                        [_short_path(frame["path"]), frame["lineno"], frame["func"], ""]
                    )
                elif segment.frames and not segment.frames[-1][3] and _is_code_line(line):
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
                    _looks_like_exception(exc["type"]) or (adjacent and _is_class_name(exc["type"]))
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

    def _latest(self, state: str) -> _Trace | None:
        for trace in reversed(self._traces):
            if trace.state == state:
                return trace
        return None

    def _start_trace(self, line: str) -> None:
        n = self.line_no
        thread = None
        lines = [line]
        start = n
        ignored = False
        announced = self._announced
        while announced and self._ordinary_lines - announced[0][3] > ANNOUNCE_REACH:
            announced.popleft()
        if announced:
            thread, header, start, _ = announced.popleft()
            lines = [header, line]
            ignored = header.startswith(_IGNORED)
        # What the thread was doing when it failed, before it prints anything else.
        device, stage = self._threads.get(thread or "", (None, None))
        self._traces.append(
            _Trace(
                thread=thread,
                start_line=start,
                lines=lines,
                segments=[_Segment()],
                end_line=n,
                ignored=ignored,
                device=device,
                stage=stage,
            )
        )

    def _close_trace(self, trace: _Trace, out: list[CrashEvent]) -> None:
        if trace in self._traces:
            self._traces.remove(trace)
        if trace.ignored:
            return
        event = self._classify_trace(trace)
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
        event.excerpt = _trim_excerpt(event.excerpt)
        self._emit(event, out)

    def _classify_trace(self, trace: _Trace) -> CrashEvent | None:
        lines = trace.lines
        for rule in self._trace_rules:
            if rule.unless and any(u.search(text) for u in rule.unless for text in lines):
                continue
            hit_index = None
            if rule.patterns:
                hit_index = next(
                    (
                        i
                        for i, text in enumerate(lines)
                        if any(p.search(text) for p in rule.patterns)
                    ),
                    None,
                )
                if hit_index is None:
                    continue
            segment = _segment_for(trace, rule, hit_index)
            if segment is None:
                continue
            return self._trace_event(trace, rule, segment)
        return None

    def _trace_event(self, trace: _Trace, rule: Rule, segment: _Segment) -> CrashEvent:
        last_frame = None
        message = segment.exc_message
        if segment.frames:
            code = segment.frames[-1][3]
            last_frame = _frame_text(segment.frames[-1])
            if message is None and segment.exc_type == "AssertionError" and code:
                message = code  # a bare assert: the asserted line says what failed
        device, stage = trace.device, trace.stage
        if device is None and message:
            gpu = _GPU_IN_MESSAGE.search(message)
            if gpu:
                device = f"cuda:{gpu[1] or gpu[2]}"
        return CrashEvent(
            rule=rule.name,
            category=rule.category,
            severity=rule.severity,
            retryable=rule.retryable,
            hint=rule.hint,
            line=trace.start_line,
            end_line=trace.end_line or trace.start_line,
            thread=trace.thread,
            device=device,
            stage=stage,
            exception=segment.exc_type,
            message=message,
            last_frame=last_frame,
            excerpt=list(trace.lines),
        )

    # --- ordinary lines -----------------------------------------------------------------

    def _feed_candidate(self, line: str, out: list[CrashEvent]) -> None:
        n = self.line_no
        if line.startswith(TRACEBACK_HEADER):
            self._start_trace(line)
            return
        announce = _ANNOUNCE_FAILED.match(line) or _ANNOUNCE_THREAD.match(line)
        if announce:
            self._announced.append(
                (self._qualify(announce["thread"]), line, n, self._ordinary_lines)
            )
            return
        if line.startswith(_IGNORED):
            self._announced.append((None, line, n, self._ordinary_lines))
            return
        for rule in self._keyed_line_rules:
            if any(k in line for k in rule.keywords or ()) and rule.matches_line(line):
                self._one_line_match(rule, line, out)
                return
        for rule in self._unkeyed_line_rules:
            if rule.matches_line(line):
                self._one_line_match(rule, line, out)
                return

    def _one_line_match(self, rule: Rule, line: str, out: list[CrashEvent]) -> None:
        n = self.line_no
        for pending in self._pending:
            if pending.event.category == rule.category:  # repeats, other ranks, echoes
                pending.last_match = n
                pending.event.end_line = n
                if len(pending.event.excerpt) < MAX_EXCERPT:
                    pending.event.excerpt.append(line)
                return
        for crash in reversed(self.crashes):
            if crash.category == rule.category and crash.end_line >= n - MERGE_WINDOW:
                # The same failure told again (C++ `what():` after the Python traceback).
                crash.end_line = n
                if len(crash.excerpt) < MAX_EXCERPT:
                    crash.excerpt.append(line)
                return
        thread = device = stage = None
        staged = _STAGE.match(line)
        if staged:
            thread, device = self._qualify(staged["thread"]), staged["device"]
            text = staged["stage"]
            stage = self._threads.get(thread, (None, None))[1]
        else:
            text = line.strip()
        exc_type = None
        exc = _EXCEPTION_PREFIX.match(text)
        if exc and _looks_like_exception(exc["type"]):
            exc_type, text = exc["type"], exc["msg"]
        event = CrashEvent(
            rule=rule.name,
            category=rule.category,
            severity=rule.severity,
            retryable=rule.retryable,
            hint=rule.hint,
            line=n,
            end_line=n,
            thread=thread,
            device=device,
            stage=stage,
            exception=exc_type,
            message=text,
            excerpt=[line],
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

    def _events_from_exit_code(self, exit_code: int | None) -> list[CrashEvent]:
        if exit_code is None or exit_code == 0:
            return []
        signal = -exit_code if exit_code < 0 else exit_code - 128 if 128 < exit_code < 160 else None
        if signal in (2, 15):  # SIGINT / SIGTERM: stopped on purpose (dflashctl stop), not a crash
            return []
        seen = {event.category for event in self.crashes}
        by_signal = {
            9: ("killed", "SIGKILL"),
            11: ("segfault", "SIGSEGV"),
            6: ("aborted", "SIGABRT"),
        }
        if signal in by_signal:
            category, name = by_signal[signal]
            if category in seen or (category == "aborted" and self.crashes):
                return []
            same = [r for r in self.rules if r.category == category]
            rule = next((r for r in same if r.name == category), same[0] if same else None)
            if rule is not None:
                return [
                    self._exit_event(
                        rule.name,
                        category,
                        rule.hint,
                        rule.severity,
                        rule.retryable,
                        f"exit status {exit_code} ({name})",
                    )
                ]
        if self.crashes:
            return []
        return [
            self._exit_event(
                "nonzero_exit",
                "exit_status",
                NONZERO_EXIT_HINT,
                "fatal",
                False,
                f"exit status {exit_code}",
            )
        ]

    def _exit_event(
        self, rule: str, category: str, hint: str, severity: str, retryable: bool, message: str
    ) -> CrashEvent:
        return CrashEvent(
            rule=rule,
            category=category,
            severity=severity,
            retryable=retryable,
            hint=hint,
            line=self.line_no,
            end_line=self.line_no,
            message=message,
            excerpt=list(self._recent),
        )

    def _emit(self, event: CrashEvent, out: list[CrashEvent]) -> None:
        index = len(self.crashes)
        while index > 0 and self.crashes[index - 1].line > event.line:
            index -= 1
        self.crashes.insert(index, event)
        for i, crash in enumerate(self.crashes):
            crash.is_root_cause = i == 0
        out.append(event)


def classify_text(
    lines: Iterable[str], exit_code: int | None, rules: Sequence[Rule]
) -> list[CrashEvent]:
    """All crashes in a finished log, root cause first (for `dflashctl logs --file`)."""
    detector = CrashDetector(rules)
    for line in lines:
        detector.feed(line)
    detector.finish(exit_code)
    return list(detector.crashes)


# --- helpers ------------------------------------------------------------------------------


def keyword_gate(keywords: Iterable[str]):
    """A function telling whether a line contains any of `keywords`, as one regex.

    The keywords are merged into a trie-shaped regex: the engine then tests each
    position of a line against one character class instead of every keyword in turn.
    Each keyword is first cut to start at its rarest character (a capital letter
    rather than a space), because the engine only tries positions holding one of the
    first characters: a gate of capital letters skips a step line at C speed.
    """
    trie: dict = {}
    for word in {_rare_anchor(k.strip()) for k in keywords if k.strip()}:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def to_regex(node: dict) -> str:
        if "" in node:
            return ""  # a shorter keyword already suffices
        branches = [re.escape(char) + to_regex(child) for char, child in sorted(node.items())]
        return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"

    if not trie:
        return lambda line: False
    return re.compile(to_regex(trie)).search


_LETTERS_BY_FREQUENCY = "etaoinshrdlcumwfgypbvkjxqz"  # English text, most frequent first


def _rare_anchor(keyword: str, min_length: int = 5) -> str:
    """The suffix of `keyword` that starts at its rarest character (any suffix will do:
    a line holding the keyword holds each of its suffixes)."""

    def rarity(char: str) -> int:
        if char.isupper() or char in "`_()[]{}<>=!@#$%^&*;'\"\\":
            return 100
        if char in _LETTERS_BY_FREQUENCY:
            return _LETTERS_BY_FREQUENCY.index(char)
        return -1  # spaces, digits, . : / | - are everywhere in a log

    best, best_rarity = 0, -2
    for index in range(max(1, len(keyword) - min_length + 1)):
        if rarity(keyword[index]) > best_rarity:
            best, best_rarity = index, rarity(keyword[index])
    return keyword[best:]


def _segment_for(trace: _Trace, rule: Rule, hit_index: int | None) -> _Segment | None:
    if rule.exception is not None or rule.last_frame is not None:
        for segment in reversed(trace.segments):
            if rule.exception is not None and not (
                segment.exc_type and rule.exception.search(segment.exc_type)
            ):
                continue
            if rule.last_frame is not None:
                if not segment.frames:
                    continue
                if not rule.last_frame.search(_frame_text(segment.frames[-1])):
                    continue
            return segment
        return None
    if hit_index is not None:
        # A rule that matched an exception line names that exception; any other hit
        # (a frame, a header) is described by the exception that ended the chain.
        for segment in trace.segments:
            if segment.exc_index == hit_index:
                return segment
    # The exception that ended the run is the last one of the chain.
    for segment in reversed(trace.segments):
        if segment.exc_type:
            return segment
    return trace.segments[-1]


def _looks_like_exception(type_name: str) -> bool:
    last = type_name.rsplit(".", 1)[-1]
    if last.isupper() or not last[:1].isupper():  # WARNING:, INFO:, logger.names
        return False
    return last.endswith(_EXCEPTION_SUFFIXES) or "." in type_name


def _frame_text(frame: list) -> str:
    path, lineno, func, _ = frame
    return f"{path}:{lineno} in {func}" if func else f"{path}:{lineno}"


def _is_class_name(type_name: str) -> bool:
    last = type_name.rsplit(".", 1)[-1]
    return last[:1].isupper() and not last.isupper()


def _is_code_line(line: str) -> bool:
    text = line.strip()
    return bool(text) and not set(text) <= set("^~ ") and not text.startswith("...")


def _short_path(path: str) -> str:
    return _SITE_PACKAGES.sub("", path)


def _last_redraw(line: str) -> str:
    parts = [part for part in line.split("\r") if part.strip()]
    return parts[-1] if parts else ""


def _trim_excerpt(lines: list[str]) -> list[str]:
    if len(lines) <= MAX_EXCERPT:
        return lines
    head = MAX_EXCERPT // 3
    tail = MAX_EXCERPT - head - 1
    return lines[:head] + [f"... {len(lines) - head - tail} lines left out ..."] + lines[-tail:]
