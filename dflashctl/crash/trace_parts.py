"""The parts of a Python traceback the detector puts together (one segment per chained
exception) and the small text helpers it reads them with. Standard library only."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dflashctl.crash.events import CrashEvent
from dflashctl.crash.rules import Rule

TAIL_REACH = 6  # lines after an exception line in which a chained traceback may continue
MAX_EXCERPT = 60
_GPU_IN_MESSAGE = re.compile(r"\bGPU (\d+)\b|\bcuda:(\d+)\b")
_SITE_PACKAGES = re.compile(r"^.*[/\\](?:site|dist)-packages[/\\]")
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


@dataclass
class Segment:
    """One traceback of a chain: its frames and the exception that ended it."""

    frames: list[list] = field(default_factory=list)  # [path, lineno, func or None, code]
    exc_type: str | None = None
    exc_message: str | None = None
    exc_index: int = -1  # index in Trace.lines of the exception line


@dataclass
class Trace:
    thread: str | None
    start_line: int
    lines: list[str]
    segments: list[Segment]
    state: str = "frames"  # frames -> tail (exception seen) -> chain (marker seen) -> frames
    tail_left: int = TAIL_REACH
    continuation_left: int = 0
    end_line: int = 0
    ignored: bool = False  # announced by "Exception ignored in ...": not a crash
    device: str | None = None  # the thread's, when its traceback started
    stage: str | None = None
    rank: int | None = None  # the rank that printed it
    local_rank: int | None = None  # its local rank, from a [defaultN]: prefix


def segment_for(trace: Trace, rule: Rule, hit_index: int | None) -> Segment | None:
    if rule.exception is not None or rule.last_frame is not None:
        for segment in reversed(trace.segments):
            if rule.exception is not None and not (
                segment.exc_type and rule.exception.search(segment.exc_type)
            ):
                continue
            if rule.last_frame is not None and not (
                segment.frames and rule.last_frame.search(frame_text(segment.frames[-1]))
            ):
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


def looks_like_exception(type_name: str) -> bool:
    last = type_name.rsplit(".", 1)[-1]
    if last.isupper() or not last[:1].isupper():  # WARNING:, INFO:, logger.names
        return False
    return last.endswith(_EXCEPTION_SUFFIXES) or "." in type_name


def frame_text(frame: list) -> str:
    path, lineno, func, _ = frame
    return f"{path}:{lineno} in {func}" if func else f"{path}:{lineno}"


def is_class_name(type_name: str) -> bool:
    last = type_name.rsplit(".", 1)[-1]
    return last[:1].isupper() and not last.isupper()


def is_code_line(line: str) -> bool:
    text = line.strip()
    return bool(text) and not set(text) <= set("^~ ") and not text.startswith("...")


def short_path(path: str) -> str:
    return _SITE_PACKAGES.sub("", path)


def last_redraw(line: str) -> str:
    parts = [part for part in line.split("\r") if part.strip()]
    return parts[-1] if parts else ""


def trim_excerpt(lines: list[str]) -> list[str]:
    if len(lines) <= MAX_EXCERPT:
        return lines
    head = MAX_EXCERPT // 3
    tail = MAX_EXCERPT - head - 1
    return lines[:head] + [f"... {len(lines) - head - tail} lines left out ..."] + lines[-tail:]


def classify_trace(trace: Trace, rules: list[Rule]) -> CrashEvent | None:
    """The event a complete traceback makes: the first rule that matches it names it."""
    lines = trace.lines
    for rule in rules:
        if rule.unless and any(u.search(text) for u in rule.unless for text in lines):
            continue
        hit_index = None
        if rule.patterns:
            hit_index = next(
                (i for i, text in enumerate(lines) if any(p.search(text) for p in rule.patterns)),
                None,
            )
            if hit_index is None:
                continue
        segment = segment_for(trace, rule, hit_index)
        if segment is None:
            continue
        return trace_event(trace, rule, segment)
    return None


def trace_event(trace: Trace, rule: Rule, segment: Segment) -> CrashEvent:
    last_frame = None
    message = segment.exc_message
    if segment.frames:
        code = segment.frames[-1][3]
        last_frame = frame_text(segment.frames[-1])
        if message is None and segment.exc_type == "AssertionError" and code:
            message = code  # a bare assert: the asserted line says what failed
    device, stage = trace.device, trace.stage
    if device is None and message:
        gpu = _GPU_IN_MESSAGE.search(message)
        if gpu:
            device = f"cuda:{gpu[1] or gpu[2]}"
    return CrashEvent.of_rule(
        rule,
        trace.start_line,
        trace.end_line or trace.start_line,
        thread=trace.thread,
        device=device,
        stage=stage,
        exception=segment.exc_type,
        message=message,
        last_frame=last_frame,
        excerpt=list(trace.lines),
        rank=trace.rank,
        local_rank=trace.local_rank,
    )
