"""Which of a log's crashes is the root cause, and which are consequences of another's.

Past one process the first failure in the log is often not the cause: when rank 1 is
killed, rank 0 notices first and says so (the trainer's `PeerFailure`, a gloo collective
whose peer closed the connection), and torchrun names rank 1 only at the end, in its
summary. So:

1. torchrun's "Root Cause (first observed failure)" names the rank that failed first:
   that rank's own failure is the root cause (its first one that is not a consequence,
   or what torchrun says of it: "rank 1 killed (SIGKILL)").
2. Else the first failure that is not a consequence, of any rank (torchrun's choice
   goes by timestamps in whole seconds, and may name a rank that only followed).
3. Then a rank that hung (its watchdog's line, crash/hangs.py), then a collective that
   timed out waiting (its culprit is the rank that never joined it: culprit.py).
4. Failing that, the first failure that names another rank (peer_lost, peer_failure),
   the named rank's first; then simply the first.
Standard library only (the run's supervisor decides with it too).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dflashctl.crash.events import CrashEvent

# The trainer's own word that another rank failed first or fell silent.
PEER_CATEGORIES = frozenset({"peer_failure", "peer_lost"})
# A rank whose steps stopped (crash/hangs.py), and collectives that waited past their
# timeout for a rank that never joined them (crash/culprit.py names that rank).
HANG_CATEGORIES = frozenset({"hang"})
WAITING_CATEGORIES = frozenset({"gloo_timeout", "nccl_timeout"})
# How a process ended, with no cause of its own in its words.
ENDINGS = frozenset({"aborted", "exit_status"})
# torchrun stopping its ranks because it was told to (a signal): no cause of its own.
STOP_CATEGORIES = frozenset({"terminated"})
# A collective or store whose other end went away, or a process told to stop: these
# name no cause of their own (a peer died, or someone stopped the job).
CONSEQUENCE_TEXT = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crash|"
    r"SignalException|got signal: \d+|Broken pipe|Socket Timeout|"
    r"NCCL communicator was aborted|ProcessGroup.* aborted|"
    r"\(after an earlier failure\):$",
    re.IGNORECASE,
)


def is_consequence(event: CrashEvent) -> bool:
    """Another rank's failure (or a stop) caused this one, as far as its words tell."""
    if event.category in PEER_CATEGORIES or event.category in STOP_CATEGORIES:
        return True
    text = " ".join(filter(None, [event.exception, event.message]))
    if CONSEQUENCE_TEXT.search(text):
        return True
    header = event.excerpt[0] if event.excerpt else ""
    return header.endswith("(after an earlier failure):")


def choose_root(crashes: Sequence[CrashEvent], named_rank: int | None) -> CrashEvent | None:
    """The root cause among `crashes` (in log order); `named_rank`: torchrun's."""
    if not crashes:
        return None
    own = [e for e in crashes if named_rank is not None and e.rank == named_rank]
    real = [e for e in own if not is_consequence(e) and not _waited(e)]
    if real:
        return real[0]
    # torchrun's first observed failure is the first error file by its timestamp, in
    # whole seconds: of two ranks failing in the same second it may name the one that
    # only followed. A failure of another rank's own then tells more.
    real = [e for e in crashes if not is_consequence(e) and not _waited(e)]
    waiting = {e.rank for e in crashes if e.category in WAITING_CATEGORIES}
    # The process taken down after its own collective timed out (NCCL's watchdog aborts
    # it): the end of that timeout, not a cause of its own.
    real = [
        e
        for e in real
        if not (e.category in ENDINGS and (e.rank is None or e.rank in waiting) and waiting)
    ]
    if real:
        return real[0]
    # A rank that hung (its own watchdog said so) is the cause of the collective that
    # timed out waiting for it; a collective timing out, of the peers' failures.
    for kind in (HANG_CATEGORIES, WAITING_CATEGORIES):
        found = [e for e in crashes if e.category in kind]
        if found:
            return found[0]
    for group in (own, crashes):
        peers = [e for e in group if e.category in PEER_CATEGORIES]
        if peers:
            return peers[0]
    return own[0] if own else crashes[0]


def _waited(event: CrashEvent) -> bool:
    """A hang, or a collective timing out: a rank's own failure outranks either."""
    return event.category in HANG_CATEGORIES | WAITING_CATEGORIES


def rank_crashes(crashes: list[CrashEvent], named_rank: int | None) -> list[CrashEvent]:
    """Root cause first, the consequences after it in log order; flags set."""
    root = choose_root(crashes, named_rank)
    ordered = sorted(crashes, key=lambda e: e.line)
    if root is not None:
        ordered.remove(root)
        ordered.insert(0, root)
    for event in ordered:
        event.is_root_cause = event is root
    return ordered


# The trainer's own word on which of its threads failed, after their tracebacks.
_TRAINING_FAILED = re.compile(
    r"^training failed.*?: (?P<thread>[A-Za-z][\w.-]*)(?: on (?P<device>[\w:]+))? failed: "
    r"(?P<type>[\w.]+): (?P<message>.*)$"
)


def training_failed(line: str) -> tuple[str, str | None, str, str] | None:
    """(thread, device, exception type, message) of "training failed: drafter-0 on cpu
    failed: KeyError: ..." (the trainer's run.py)."""
    found = _TRAINING_FAILED.match(line)
    return found.group("thread", "device", "type", "message") if found else None


def prefer_named(
    ranked: list[CrashEvent], thread: str, device: str | None, exc_type: str, message: str
) -> list[CrashEvent]:
    """The trainer said which of its threads failed ("training failed: drafter-0 on cpu
    failed: KeyError: ..."): of the root cause's rank, the failure it names is the root
    cause, with that thread, over another thread's traceback printed at the same time."""
    root = ranked[0]
    if is_consequence(root) or root.category not in _THREAD_CATEGORIES:
        return ranked
    for event in ranked:
        if event.rank != root.rank or event.category not in _THREAD_CATEGORIES:
            continue
        short = (event.exception or "").rsplit(".", 1)[-1]
        if short == exc_type.rsplit(".", 1)[-1] and (event.message or "")[:60] == message[:60]:
            event.thread, event.device = thread, event.device or device
            ordered = [event, *[e for e in ranked if e is not event]]
            for item in ordered:
                item.is_root_cause = item is event
            return ordered
    return ranked


# Failures a traceback of some thread tells (the trainer's line can name its thread).
_THREAD_CATEGORIES = frozenset({"thread_exception", "python_exception"})
