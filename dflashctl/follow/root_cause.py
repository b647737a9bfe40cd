"""The root cause of a run across several nodes: the first failure in time, as
torchelastic's "first observed failure" names it, with the failures a rank's death
causes on the other nodes kept apart as consequences.

Pure functions over NodeFailure records (dflashctl/follow/multinode.py makes them while it
follows), so that the ordering is tested on its own:

    cause, consequences = first_failure(failures)

Ordering, most telling first:
1. A failure that is a consequence of another rank's (the trainer's `PeerFailure`:
   crash categories peer_failure and peer_lost; a gloo/NCCL connection the dead peer
   closed; torchrun stopped by a signal) never beats one that is not.
2. Then the earliest time: when the follower saw the failure while following live (one
   clock, ours, for every node), else when the node's run ended (its supervisor's
   `ended_unix`, the container's clock).
3. Then the node's order in dflash.yaml.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflashctl.crash import CrashEvent

# The trainer's own word that another rank failed first or fell silent.
CONSEQUENCE_CATEGORIES = frozenset({"peer_failure", "peer_lost"})
# A collective or store whose other end went away, or torchrun told to stop: these name
# no cause of their own (a peer died, or someone stopped the job).
_CONSEQUENCE_TEXT = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crash|"
    r"SignalException|got signal: \d+|Broken pipe",
    re.IGNORECASE,
)
_THREAD_RANK = re.compile(r"\(rank (\d+)\)$")
# torchrun's ChildFailedError summary ("Root Cause (first observed failure):"):
#   time      : 2026-11-30_20:50:42
#   rank      : 1 (local_rank: 0)
#   exitcode  : -9 (pid: 27599)  (SIGKILL)
#   traceback : Signal 9 (SIGKILL) received by PID 27599
_TORCHRUN_FIELD = re.compile(r"^\s+(time|host|rank|exitcode|traceback)\s*:\s*(.*\S)\s*$")
_TORCHRUN_RANK = re.compile(r"^(\d+) \(local_rank: (\d+)\)")
_TORCHRUN_EXIT = re.compile(r"^(-?\d+) \(pid: (\d+)\)")
_ROOT_CAUSE_HEADER = "Root Cause (first observed failure):"
# The line torchrun logs first, before its ChildFailedError and summary:
#   E1130 20:50:42.344000 27594 torch/.../api.py:1002] failed (exitcode: -9) local_rank: 0 (pid: 27599) of binary: ...
_FAILED_LINE = re.compile(r"\] failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
# torchrun stopping its other local ranks: one of them failed (its summary comes only
# once they have stopped, which may take the grace period), unless torchrun itself was
# told to stop first ("Received 15 death signal, shutting down workers").
_CLOSING = re.compile(r"\] Sending process \d+ closing signal SIG\w+")
_TOLD_TO_STOP = re.compile(r"\] Received \d+ death signal, shutting down workers")
_PEER_NAMED = re.compile(
    r"PeerFailure: .*?rank (\d+)(?: on host (\S+))? (?:failed|stopped answering)"
)


@dataclass
class TorchrunFailure:
    """What torchrun's failure summary says about the rank that failed on its node."""

    rank: int | None = None
    local_rank: int | None = None
    exitcode: int | None = None  # negative: killed by that signal
    pid: int | None = None
    time: str | None = None  # as torchrun wrote it (the node's local clock)
    traceback: str | None = None

    def describe(self) -> str:
        """`exit code -9 (SIGKILL), pid 27599`."""
        parts = []
        if self.exitcode is not None:
            what = f"exit code {self.exitcode}"
            if self.exitcode < 0:
                from dflashctl.runs import signal_name

                what = f"killed by {signal_name(-self.exitcode)}"
            parts.append(what)
        if self.pid is not None:
            parts.append(f"pid {self.pid}")
        return ", ".join(parts)


class TorchrunWatch:
    """Reads a node's log lines for torchrun's "Root Cause (first observed failure)"
    block and keeps what it says (the first block only: torchrun prints one per job);
    notes the moment torchrun starts stopping the other local ranks after a failure."""

    def __init__(self) -> None:
        self.failure: TorchrunFailure | None = None
        # torchrun began stopping its other ranks because one failed: the first sign.
        self.rank_failed = False
        self._told_to_stop = False
        self._in_block = False
        self._done = False

    def feed(self, line: str) -> None:
        if "] Received " in line and _TOLD_TO_STOP.search(line):
            self._told_to_stop = True
        elif "] Sending process " in line and not self._told_to_stop and _CLOSING.search(line):
            self.rank_failed = True
        if self._done:
            return
        if not self._in_block:
            if line.startswith(_ROOT_CAUSE_HEADER):
                self._in_block = True
                self.failure = self.failure or TorchrunFailure()
            elif "] failed (exitcode: " in line and (failed := _FAILED_LINE.search(line)):
                self.failure = self.failure or TorchrunFailure()
                self.failure.exitcode = int(failed[1])
                self.failure.local_rank, self.failure.pid = int(failed[2]), int(failed[3])
            return
        if line.startswith("====="):
            self._in_block, self._done = False, True
            return
        found = _TORCHRUN_FIELD.match(line)
        if found is None or self.failure is None:
            return
        key, value = found.groups()
        if key == "rank" and (rank := _TORCHRUN_RANK.match(value)):
            self.failure.rank, self.failure.local_rank = int(rank[1]), int(rank[2])
        elif key == "exitcode" and (code := _TORCHRUN_EXIT.match(value)):
            self.failure.exitcode, self.failure.pid = int(code[1]), int(code[2])
        elif key == "time":
            self.failure.time = value
        elif key == "traceback" and value != "<N/A>":
            self.failure.traceback = value


@dataclass
class NodeFailure:
    """A node's first failure: its crash event (None when only the run's end told us:
    an exit status, a lost process), when it was seen, and what torchrun said of it."""

    node: str
    index: int  # the node's place in dflash.yaml
    event: CrashEvent | None = None
    seen_at: float | None = None  # time.time() when seen live; None: it was in the backlog
    ended_at: float | None = None  # the node's run ended then (its supervisor's clock)
    state: str | None = None  # the run's end in words: "crashed (killed by SIGKILL)"
    torchrun: TorchrunFailure | None = None
    # Consequence of another node's failure, as the trainer or torchrun said it.
    names_rank: int | None = None  # the rank a PeerFailure names as failing first

    @property
    def consequence(self) -> bool:
        event = self.event
        if event is None:
            return False
        if event.category in CONSEQUENCE_CATEGORIES:
            return True
        text = " ".join(filter(None, [event.exception, event.message]))
        return bool(_CONSEQUENCE_TEXT.search(text))

    @property
    def when(self) -> float | None:
        return self.seen_at if self.seen_at is not None else self.ended_at

    @property
    def rank(self) -> int | None:
        """The global rank that failed: the crash's thread says `(rank N)` for ranks
        other than 0; torchrun's summary names the rank it lost."""
        event = self.event
        if event is not None and event.thread:
            found = _THREAD_RANK.search(event.thread)
            if found:
                return int(found[1])
        if self.torchrun is not None and self.torchrun.rank is not None:
            return self.torchrun.rank
        return None

    def thread(self) -> str | None:
        """The thread without its `(rank N)` qualifier."""
        if self.event is None or not self.event.thread:
            return None
        return _THREAD_RANK.sub("", self.event.thread).strip() or None

    def what(self) -> str:
        """What failed, in one line: `AssertionError: tree manager ...`, `killed by SIGKILL`."""
        if self.torchrun is not None and (self.event is None or _says_only_torchrun(self.event)):
            said = self.torchrun.describe()
            if said:
                return said
        if self.event is not None:
            return self.event.summary
        return self.state or "failed"

    def describe(self) -> str:
        """`node gpu-b, rank 1, thread drafter-2 on cpu: AssertionError: ...`."""
        parts = [f"node {self.node}"]
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        elif self.torchrun is not None and self.torchrun.local_rank is not None:
            parts.append(f"local rank {self.torchrun.local_rank}")
        thread = self.thread()
        if thread:
            device = f" on {self.event.device}" if self.event and self.event.device else ""
            parts.append(f"thread {thread}{device}")
        return ", ".join(parts) + f": {self.what()}"

    def to_json(self) -> dict[str, Any]:
        event = self.event
        return {
            "node": self.node,
            "rank": self.rank,
            "thread": self.thread(),
            "device": event.device if event else None,
            "category": event.category if event else None,
            "exception": event.exception if event else None,
            "message": event.message if event else None,
            "summary": self.what(),
            "state": self.state,
            "seen_at": self.seen_at,
            "ended_at": self.ended_at,
            "consequence": self.consequence,
            "torchrun": None if self.torchrun is None else vars(self.torchrun),
        }


def first_failure(
    failures: list[NodeFailure],
) -> tuple[NodeFailure | None, list[NodeFailure]]:
    """(the root cause, the other nodes' failures in time order): see the module doc."""
    if not failures:
        return None, []
    ordered = sorted(failures, key=_order)
    return ordered[0], ordered[1:]


def _order(failure: NodeFailure) -> tuple[bool, bool, float, int]:
    when = failure.when
    return (failure.consequence, when is None, when or 0.0, failure.index)


def named_rank(event: CrashEvent | None) -> int | None:
    """The rank a PeerFailure names as the one that failed first or fell silent."""
    if event is None or event.category not in CONSEQUENCE_CATEGORIES:
        return None
    for text in [f"PeerFailure: {event.message or ''}", *event.excerpt]:
        found = _PEER_NAMED.search(text)
        if found:
            return int(found[1])
    return None


def _says_only_torchrun(event: CrashEvent) -> bool:
    """torchrun's ChildFailedError, or no more than its exit status: its summary of the
    failed rank says more."""
    return event.category == "exit_status" or (event.exception or "").endswith("ChildFailedError")
