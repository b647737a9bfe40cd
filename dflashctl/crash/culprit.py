"""The rank that failed, not the one that noticed.

When the root cause of a run is a rank saying that another one failed or fell silent,
the rank named is the one at fault:

- the trainer's PeerFailure names it: `rank 1 on host gpu-b stopped answering`,
  `rank 0 failed: rank 0/2 on host vm (pid 25266): drafter-0 on cpu failed: ...`
  (with its thread and device);
- a collective that timed out (gloo, NCCL) waited for the ranks that never issued it:
  those of the job that did not time out themselves (with two ranks, the other one).

The event then carries the culprit's rank, node, host and pid (what the log says of
it), none of the noticing rank's thread or device, and `details.noticed_by` says who
noticed. Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from dflashctl.crash.events import CrashEvent
from dflashctl.crash.ordering import WAITING_CATEGORIES, prefer_named, rank_crashes
from dflashctl.crash.ranks import RankBook

_FAILED = re.compile(
    r"\brank (?P<rank>\d+) failed: (?:rank \d+/\d+ on host (?P<host>\S+) \(pid (?P<pid>\d+)\): )?"
    r"(?:(?P<thread>[A-Za-z][\w.-]*) on (?P<device>\w+(?::\d+)?) failed: )?"
)
_SILENT = re.compile(r"\brank (?P<rank>\d+) on host (?P<host>\S+) stopped answering")
# What details.noticed_by keeps of the rank that noticed (blame gives the event the
# culprit's, unblame gives them back).
_NOTICED = ("rank", "local_rank", "node", "host", "pid", "thread", "device", "stage")


def blame(
    root: CrashEvent,
    crashes: Sequence[CrashEvent],
    ranks: RankBook,
    stuck: dict[int | None, list[str]] | None = None,
    thread_state=None,
) -> None:
    """Give `root` the culprit's rank when its words name another one (see module doc).
    `stuck`: per rank, the threads its own lines said were stuck (crash/hangs.py)."""
    if "noticed_by" in root.details or root.rank is None:
        return
    culprit: int | None = None
    thread = device = host = pid = None
    text = " ".join(filter(None, [root.exception, root.message]))
    if root.category in ("peer_lost", "peer_failure"):
        found = _FAILED.search(text) or _SILENT.search(text)
        if found is None:
            return
        culprit = int(found["rank"])
        groups = found.groupdict()
        thread, device = groups.get("thread"), groups.get("device")
        host, pid = groups.get("host"), groups.get("pid")
    elif root.category in WAITING_CATEGORIES and ranks.world_size:
        timed_out = {e.rank for e in crashes if e.category in WAITING_CATEGORIES}
        silent = [r for r in range(ranks.world_size) if r not in timed_out]
        if len(silent) != 1:
            return
        culprit = silent[0]
        root.details["never_joined"] = silent
        # The culprit's own word on which thread never got there, when it gave one.
        thread = ((stuck or {}).get(culprit) or [None])[0]
    if culprit is None or culprit == root.rank:
        return
    root.details["noticed_by"] = {key: getattr(root, key) for key in _NOTICED}
    info = ranks.info(culprit)
    root.rank = culprit
    root.local_rank = info.local_rank if info is not None else None
    root.host = (info.host if info is not None else None) or host
    root.pid = (info.pid if info is not None else None) or (int(pid) if pid else None)
    root.node = ranks.node_of(culprit) if info is not None else None
    root.thread, root.device = thread, device
    root.stage = None
    if thread is not None and device is None and thread_state is not None:
        root.device, root.stage = thread_state(culprit, thread)


def unblame(event: CrashEvent) -> None:
    """Undo blame (the root cause may change as more of the log is read)."""
    noticed = event.details.pop("noticed_by", None)
    event.details.pop("never_joined", None)
    for key, value in (noticed or {}).items():
        setattr(event, key, value)


def own_rank(event: CrashEvent) -> int | None:
    """The rank whose lines told of `event` (before blame gave it the culprit's)."""
    noticed = event.details.get("noticed_by")
    return noticed["rank"] if noticed else event.rank


def rank_and_blame(detector: Any) -> list[CrashEvent]:
    """A CrashDetector's crashes, the root cause first (ordering.py), preferring the
    failure the trainer's own line names, and named after the culprit (blame)."""
    for event in detector.in_log_order:
        unblame(event)  # as ranked before: the root cause may have changed since
    ranked = rank_crashes(detector.in_log_order, detector.named_rank)
    if ranked:
        named = detector.named_failures.get(own_rank(ranked[0]))
        if named is not None:
            ranked = prefer_named(ranked, *named)
        stuck = {rank: s.threads for rank, s in detector.hangs.silences.items()}
        blame(ranked[0], ranked, detector.ranks, stuck, detector.thread_state)
    return ranked
