"""Failures told by how a run ended rather than by a traceback: its exit status, and
torchrun's summary of the rank that failed first (a rank killed by a signal prints
nothing of its own). Standard library only."""

from __future__ import annotations

from typing import Any

from dflashctl.crash.events import CrashEvent
from dflashctl.crash.ordering import is_consequence
from dflashctl.crash.rules import Rule
from dflashctl.crash.stops import STOP_SIGNALS
from dflashctl.crash.torchrun import signal_name

# detector.py's CrashDetector, which calls these with itself: named, not imported, so
# that the two modules do not import each other.
CrashDetector = Any

NONZERO_EXIT_HINT = (
    "The run exited with a non-zero status but printed no failure dflashctl recognises. "
    "Read the last lines of the log; add a rule to crash_patterns in dflash.yaml for this "
    "message so that it is named next time."
)
# A non-zero exit status no rule explains.
NONZERO_EXIT = Rule(name="nonzero_exit", category="exit_status", hint=NONZERO_EXIT_HINT)
# A process ended by one of these signals: the category that names it.
BY_SIGNAL = {9: "killed", 11: "segfault", 7: "segfault", 6: "aborted"}


def exit_event(detector: CrashDetector, rule: Rule, message: str) -> CrashEvent:
    """An event the log's end or its exit status tells of (no traceback of its own)."""
    return CrashEvent.of_rule(
        rule, detector.line_no, message=message, excerpt=detector.recent_lines()
    )


def is_torchrun_summary(exception: str | None) -> bool:
    """torchrun's ChildFailedError: the summary after it says which rank failed, how."""
    return bool(exception) and exception.endswith("ChildFailedError")


def exit_code_events(detector: CrashDetector, exit_code: int | None) -> list[CrashEvent]:
    """What the exit status adds to what the log said."""
    if exit_code is None or exit_code == 0:
        return []
    stops = detector.stops
    if stops.info.clean:
        return []  # torchrun's 1, a second Ctrl-C's 130: the end of a clean stop
    signal = -exit_code if exit_code < 0 else exit_code - 128 if 128 < exit_code < 160 else None
    if signal in STOP_SIGNALS:  # stopped on purpose (dflashctl stop), not a crash
        return []
    if signal == 9 and stops.takes_kill():
        return []  # the stop's SIGKILL when its grace period ran out
    seen = {event.category for event in detector.in_log_order}
    if signal == 9 and "hang" in seen:
        return []  # the end of a run that hung: killed by whoever gave up waiting
    if signal == 9 and not seen and detector.line_no and not detector.program_lines:
        return [silent_from_the_start(detector)]
    category = BY_SIGNAL.get(signal) if signal is not None else None
    if category is not None:
        if category in seen or (category == "aborted" and seen):
            return []
        rule = _rule_for(detector, category)
        if rule is not None:
            return [exit_event(detector, rule, f"exit status {exit_code} ({signal_name(signal)})")]
    if seen:
        return []
    return [exit_event(detector, NONZERO_EXIT, f"exit status {exit_code}")]


def torchrun_events(detector: CrashDetector) -> list[CrashEvent]:
    """torchrun's summary just ended: fill in what it says of each failed rank's events,
    and tell the root cause's failure when its rank printed none of its own (killed by
    a signal; or its traceback only in the error file)."""
    watch = detector.torchrun
    failure = watch.failure
    if failure is None:
        return []
    for item in [failure, *watch.failures]:
        for event in detector.in_log_order:
            if item.rank is not None and event.rank == item.rank:
                event.fill_from(item)
    rank = failure.rank
    own = [e for e in detector.in_log_order if e.rank == rank and rank is not None]
    unplaced = [e for e in detector.in_log_order if e.rank is None and not is_consequence(e)]
    same_local = [e for e in unplaced if e.local_rank == failure.local_rank]
    unplaced = same_local or [e for e in unplaced if e.local_rank is None]
    if not own and unplaced and rank is not None:
        # Lines without a rank prefix (a plain traceback on the rank's stderr): the
        # first failure of its own in the log is the rank torchrun names.
        first = unplaced[0]
        first.rank = rank
        first.fill_from(failure)  # its local rank is the failure's, or none
        first.node = first.node or detector.ranks.node_of(rank)
        own = [first]
    for event in own:  # what torchrun says of the rank: exit code, time, error file
        event.details.setdefault("torchrun", failure.to_json())
    if any(not is_consequence(e) for e in own):
        return []
    signal = watch.signal_of_root()
    if signal is not None:
        if signal in STOP_SIGNALS or (signal == 9 and detector.stops.takes_kill()):
            return []  # stopped from outside (and killed when it did not stop in time)
        category = BY_SIGNAL.get(signal, "killed")
        rule = _rule_for(detector, category)
        if rule is None:
            return []
        who = f"rank {rank}" if rank is not None else f"local rank {failure.local_rank}"
        how = "killed ({})" if signal == 9 else "ended by {}"
        event = _at_summary(detector, rule, f"{who} {how.format(signal_name(signal))}")
    elif failure.has_traceback:
        event = classify_recorded_traceback(detector, failure.traceback_lines)
        if event is None or own:
            return []  # its own line (the PeerFailure it recorded) is in the log already
    elif own:
        return []
    else:
        event = _at_summary(
            detector, NONZERO_EXIT, f"rank {rank} exited with exit code {failure.exitcode}"
        )
    event.rank, event.local_rank = rank, failure.local_rank
    event.host, event.pid = failure.host, failure.pid
    event.details["told_by"] = "torchrun"  # its summary, not the rank's own lines
    event.details["torchrun"] = failure.to_json()
    event.line = event.end_line = failure.line or detector.line_no
    return [event]


def silent_from_the_start(detector: CrashDetector) -> CrashEvent:
    """Killed when torchrun had spoken (its banner) and no rank had (not one line of the
    program's: an empty log is a kill like any other, the OOM killer's say): it never got past
    start-up, most often a rendezvous that never completes (a node waiting for the
    master port another process holds, or for a node that never comes)."""
    rule = _rule_for(detector, "hang") or Rule(name="hang", category="hang", hint="")
    event = exit_event(
        detector,
        Rule(
            name=rule.name,
            category="hang",
            hint=f"{rule.hint} Here: the trainer never printed a line before it was killed: it "
            "hung in start-up, most often at the rendezvous (torchrun waiting for the master "
            "address and port: another process may hold that port, or a node never came). Look "
            "at the first node's log and `ss -ltnp` on its host.",
        ),
        "killed by SIGKILL before the trainer printed a line (hung in start-up, at the rendezvous)",
    )
    event.details.update(silent_rank=None, before_first_step=True, before_first_line=True)
    return event


def hang_events(detector: CrashDetector) -> list[CrashEvent]:
    """A hang still open when the log ended (crash/hangs.py), one per silent rank."""
    rule = _rule_for(detector, "hang")
    if rule is None:
        return []
    out = []
    for silence in detector.hangs.open:
        if silence.silent_s is None and detector.in_log_order:
            # Only a stop that found a thread still running, and a failure told (a
            # collective that timed out waiting, a peer's): the stuck thread names the
            # culprit of that failure (culprit.py), no hang of its own.
            continue
        event = exit_event(detector, rule, silence.message())
        event.line = event.end_line = silence.line
        event.excerpt = list(silence.said)
        event.rank = silence.rank
        event.thread = silence.threads[0] if silence.threads else None
        if event.thread is not None:
            event.device, event.stage = detector.thread_state(silence.rank, event.thread)
        event.details.update(silence.to_json())
        detail = silence.where()
        how_long = f"{silence.silent_s:.0f} s" if silence.silent_s is not None else "a while"
        who = f"rank {silence.rank}" if silence.rank is not None else "the run"
        stuck = (
            f", {event.thread} at {silence.waiting_at}"
            if event.thread and silence.waiting_at
            else (f", {event.thread} stuck" if event.thread else "")
        )
        said = f"{who} made no step for {how_long} {detail}{stuck}"
        if silence.stacks_file:
            said += f"; every thread's stack: {silence.stacks_file}"
        event.hint = f"{event.hint} Here: {said}."
        out.append(event)
    return out


def classify_recorded_traceback(detector: CrashDetector, lines: list[str]) -> CrashEvent | None:
    """The rank's traceback as torchelastic's error file kept it, classified alone."""
    inner = type(detector)(detector.rules)
    text = list(lines)
    if text and not text[0].startswith("Traceback"):
        text = text[:1]  # one line: an exception without a traceback
    for line in text:
        inner.feed(line)
    inner.finish(None)
    found = inner.crashes
    return found[0] if found else None


def _at_summary(detector: CrashDetector, rule: Rule, message: str) -> CrashEvent:
    event = exit_event(detector, rule, message)
    event.excerpt = event.excerpt[-10:]  # the summary's end; torchrun_events places it
    return event


def _rule_for(detector: CrashDetector, category: str):
    same = [r for r in detector.rules if r.category == category]
    return next((r for r in same if r.name == category), same[0] if same else None)


def error_file_events(detector: CrashDetector, records: list) -> list[CrashEvent]:
    """Failures torchelastic's error files tell (crash/error_files.py) that the log does
    not: added when the log names no failure of its own; else the event they match
    gets its file's path. Files older than the run's last start are an earlier
    attempt's and are left alone."""
    started = detector.started_at
    fresh = [
        r for r in records if r.timestamp is None or started is None or r.timestamp >= started - 1
    ]
    events = detector.in_log_order
    real = [e for e in events if not is_consequence(e) and e.category != "exit_status"]
    out: list[CrashEvent] = []
    for record in fresh:
        found = classify_recorded_traceback(detector, record.traceback)
        if found is None:
            continue
        same = next((e for e in events if _same_failure(e, found)), None)
        if same is not None:
            same.details.setdefault("error_file", record.path)
            continue
        if real:
            continue  # the log names the failure itself
        rank = detector.ranks.rank_of(None, record.local_rank)
        if rank is None and record.local_rank is None:
            rank = detector.named_rank
        found.rank = rank
        found.local_rank = record.local_rank
        found.details.update(error_file=record.path, told_by="error_file")
        found.line = found.end_line = detector.line_no
        found.excerpt = list(record.traceback)
        out.append(found)
        real.append(found)
    if out:  # what the exit status alone said is explained now
        for event in [e for e in events if e.category == "exit_status"]:
            events.remove(event)
    return out


def _same_failure(event: CrashEvent, other: CrashEvent) -> bool:
    if event.category != other.category:
        return False
    return (event.exception, (event.message or "")[:80]) == (
        other.exception,
        (other.message or "")[:80],
    )


def utc_seconds(text: str) -> float | None:
    """The trainer's `started YYYY-MM-DD HH:MM:SS UTC` as seconds since the epoch."""
    import calendar
    import time

    try:
        return float(calendar.timegm(time.strptime(text, "%Y-%m-%d %H:%M:%S")))
    except ValueError:
        return None
