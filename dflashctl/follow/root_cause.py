"""The root cause of a run across several nodes: the first failure in time, as
torchelastic's "first observed failure" names it, with the failures a rank's death
causes on the other nodes kept apart as consequences.

Pure functions over NodeFailure records (dflashctl/follow/fleet.py makes them while it
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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflashctl.crash.ordering import is_consequence
from dflashctl.crash.torchrun import TorchrunFailure, TorchrunWatch

if TYPE_CHECKING:
    from dflashctl.crash import CrashEvent

__all__ = ["NodeFailure", "TorchrunFailure", "TorchrunWatch", "first_failure"]


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

    @property
    def consequence(self) -> bool:
        return self.event is not None and is_consequence(self.event)

    @property
    def when(self) -> float | None:
        return self.seen_at if self.seen_at is not None else self.ended_at

    @property
    def rank(self) -> int | None:
        """The global rank that failed: the crash event's, else the one torchrun's
        summary names."""
        if self.event is not None and self.event.rank is not None:
            return self.event.rank
        if self.torchrun is not None and self.torchrun.rank is not None:
            return self.torchrun.rank
        return None

    def thread(self) -> str | None:
        return self.event.thread if self.event is not None else None

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
            "local_rank": event.local_rank if event else None,
            "host": event.host if event else None,
            "torchrun": None if self.torchrun is None else self.torchrun.to_json(),
        }


def first_failure(
    failures: list[NodeFailure],
) -> tuple[NodeFailure | None, list[NodeFailure]]:
    """(the root cause, the other nodes' failures in time order): see the module doc."""
    if not failures:
        return None, []
    ordered = sorted(
        failures, key=lambda f: (f.consequence, f.when is None, f.when or 0.0, f.index)
    )
    return ordered[0], ordered[1:]


def _says_only_torchrun(event: CrashEvent) -> bool:
    """torchrun's ChildFailedError, or no more than its exit status: its summary of the
    failed rank says more."""
    return (
        event.category == "exit_status"
        or event.details.get("told_by") == "torchrun"
        or (event.exception or "").endswith("ChildFailedError")
    )
