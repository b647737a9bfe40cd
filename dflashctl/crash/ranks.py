"""Who wrote a line of a distributed run's log: its rank, local rank, node and host.

- `[rank1]: ` (the trainer's own prefix for ranks other than 0, torch's for its C++
  logs, and torchrun's `--log-line-prefix-template` / `-l` style) and `[default0]: `
  (torchrun --tee / --redirects: the role and the LOCAL rank) in front of a line;
  torch's C++ logs also write `[rank1]:[E1129 ...`.
- the trainer's `distributed: rank 1/2 on host gpu-b (pid 4242), local rank 1/8,
  node 1/2 (gpu-b), gloo, ...` line, one per rank: which host, node, local rank and pid
  each rank has (and so what an unprefixed line's rank is: rank 0's under one torchrun,
  the node's only rank on another node).
- torchrun's summary: rank, local rank, pid and host of each failed rank.
Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PREFIX = re.compile(r"^\[(rank|default)(\d+)\]:\s?")
_DISTRIBUTED = re.compile(
    r"^distributed: rank (?P<rank>\d+)/(?P<world>\d+) on host (?P<host>\S+) \(pid (?P<pid>\d+)\)"
    r"(?:, local rank (?P<local>\d+)/\d+)?"
    r"(?:, node (?P<node>\d+)/(?P<nodes>\d+)(?: \((?P<name>[^)]*)\))?)?"
)


@dataclass
class RankInfo:
    rank: int
    world_size: int | None = None
    local_rank: int | None = None
    host: str | None = None
    pid: int | None = None
    node_rank: int | None = None
    num_nodes: int | None = None
    node_name: str | None = None


def split_prefix(line: str) -> tuple[str, int | None, int | None]:
    """(the line without its prefix, rank, local rank) from `[rankN]: ` / `[defaultN]: `."""
    found = _PREFIX.match(line) if line.startswith(("[rank", "[default")) else None
    if found is None:
        return line, None, None
    number = int(found[2])
    rest = line[found.end() :]
    if found[1] == "rank":
        return rest, number, None
    return rest, None, number


class RankBook:
    """What the log has said about each rank so far."""

    def __init__(self, node: str | None = None) -> None:
        self.node = node  # the node this log is from, when the caller knows (dflash.yaml)
        self.ranks: dict[int, RankInfo] = {}
        self.own_rank: int | None = None  # the rank whose lines carry no prefix
        self.world_size: int | None = None

    def feed(self, line: str, prefixed_rank: int | None) -> None:
        """`line` without its prefix; `prefixed_rank`: the prefix's rank, if any."""
        found = _DISTRIBUTED.match(line) if line.startswith("distributed: rank ") else None
        if found is None:
            return
        rank = int(found["rank"])
        info = self.ranks.setdefault(rank, RankInfo(rank))
        info.world_size = int(found["world"])
        info.host, info.pid = found["host"], int(found["pid"])
        if found["local"] is not None:
            info.local_rank = int(found["local"])
        if found["node"] is not None:
            info.node_rank, info.num_nodes = int(found["node"]), int(found["nodes"])
            info.node_name = found["name"] or None
        self.world_size = info.world_size
        if prefixed_rank is None:
            self.own_rank = rank

    def rank_of(self, prefixed_rank: int | None, local_rank: int | None) -> int | None:
        """The rank of a line: its prefix's, else the local rank's, else the unprefixed
        lines' own (None in a log of one process)."""
        if prefixed_rank is not None:
            return prefixed_rank
        if local_rank is not None:
            return next((i.rank for i in self.ranks.values() if i.local_rank == local_rank), None)
        return self.own_rank

    def info(self, rank: int | None) -> RankInfo | None:
        return self.ranks.get(rank) if rank is not None else None

    def node_of(self, rank: int | None) -> str | None:
        """The node's name (dflash.yaml's, as the trainer was told it), else its node
        rank as text, else the node this whole log is from."""
        info = self.info(rank)
        if info is None:
            # torchrun's own word (its exit status): one agent per node, so every rank
            # in this log is on the node this log is from.
            nodes = {(i.node_rank, i.node_name) for i in self.ranks.values()}
            info = next(iter(self.ranks.values())) if len(nodes) == 1 else None
        if info is not None and info.node_name:
            return info.node_name
        if self.node:
            return self.node
        if info is not None and info.node_rank is not None and (info.num_nodes or 1) > 1:
            return str(info.node_rank)  # "node 0/2": one node of several, without a name
        return None

    def others(self, rank: int | None) -> list[int]:
        """The other ranks of the job, when its size is known."""
        if self.world_size is None or rank is None:
            return []
        return [r for r in range(self.world_size) if r != rank]
