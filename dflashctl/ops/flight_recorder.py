"""PyTorch's NCCL flight recorder dumps, read and summarised: which rank missed which
collective.

Each rank's dump (`TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>`, a pickle) is a dict:
`version`, `pg_config` ({pg name: {"name", "desc", "ranks": "[0, 1]"}}), `pg_status`
({pg id: {"last_enqueued_collective", "last_started_collective",
"last_completed_collective"}}) and `entries`, the ring of recent operations, each with
`record_id`, `pg_id`, `process_group` ((name, desc)), `collective_seq_id`,
`p2p_seq_id`, `is_p2p`, `profiling_name` (`nccl:all_reduce`), `state` (scheduled,
started, completed), `input_sizes`, `time_created_ns`, `timeout_ms`, `frames`...
(torch/csrc/distributed/c10d/FlightRecorder.hpp; its analyzer is
torch.distributed.flight_recorder, fr_trace).

Within one process group every member issues the same collectives in the same order,
numbered by collective_seq_id. A hang leaves the ranks at different numbers: the ranks
that went furthest wait in a collective the others never issued. The summary names,
per group, the first such collective, the ranks that never issued it and those left
waiting in it; and the collectives whose members disagree (a different op or sizes).
"""

from __future__ import annotations

import ast
import io
import pickle
from dataclasses import dataclass, field
from typing import Any


class DumpError(ValueError):
    """A dump that is not a flight recorder's."""


class _DataOnly(pickle.Unpickler):
    """The dumps hold only dicts, lists, tuples, strings and numbers: a pickle naming
    any class or function is refused (a pickle can otherwise run code when loaded)."""

    def find_class(self, module: str, name: str) -> Any:
        raise DumpError(f"refused: the dump names {module}.{name}")


def load_dump(data: bytes) -> dict[str, Any]:
    try:
        dump = _DataOnly(io.BytesIO(data)).load()
    except DumpError:
        raise
    except Exception as exc:
        raise DumpError(f"not a pickle ({type(exc).__name__}: {exc})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries", []), list):
        raise DumpError("not a flight recorder dump (no `entries` list)")
    return dump


@dataclass
class RankInGroup:
    rank: int
    issued: int  # the last collective_seq_id this rank enqueued (0: none)
    completed: int  # the last it saw completed
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)  # seq -> entry


@dataclass
class Finding:
    group: str  # `0 (default_pg)`
    seq: int
    op: str  # `nccl:all_reduce`
    kind: str  # "missed" | "mismatch" | "stuck"
    ranks: list[int]  # who missed it / who disagree / who are stuck in it
    waiting: list[int] = field(default_factory=list)  # missed: those that issued it
    detail: str = ""

    def describe(self) -> str:
        ranks = _ranks(self.ranks)
        if self.kind == "missed":
            verb = "waits" if len(self.waiting) == 1 else "wait"
            waiting = f"; {_ranks(self.waiting)} issued it and {verb} in it" if self.waiting else ""
            return (
                f"{ranks} never issued collective #{self.seq} ({self.op}) of process group "
                f"{self.group}{waiting}"
            )
        if self.kind == "mismatch":
            return f"collective #{self.seq} of process group {self.group}: {self.detail}"
        return (
            f"collective #{self.seq} ({self.op}) of process group {self.group} was issued by "
            f"every member but never completed on {ranks}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "process_group": self.group,
            "collective_seq_id": self.seq,
            "profiling_name": self.op,
            "kind": self.kind,
            "ranks": self.ranks,
            "waiting": self.waiting,
            "message": self.describe(),
        }


@dataclass
class Summary:
    ranks: list[int]  # ranks with a dump
    findings: list[Finding]
    absent: list[int] = field(default_factory=list)  # members of a group without a dump
    errors: list[str] = field(default_factory=list)  # dumps that could not be read

    def lines(self) -> list[str]:
        out = []
        if self.absent:
            out.append(
                f"{_ranks(self.absent)} left no dump (the rank died, or never reached a "
                "collective timeout)"
            )
        out += [f.describe() for f in self.findings]
        if not out:
            out.append(
                "every rank reached and completed the same collectives: the hang is "
                "outside NCCL (see the threads' stacks)"
            )
        return out + self.errors

    def to_json(self) -> dict[str, Any]:
        return {
            "ranks": self.ranks,
            "absent": self.absent,
            "findings": [f.to_json() for f in self.findings],
            "errors": self.errors,
            "summary": self.lines(),
        }


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _group_key(entry: dict[str, Any]) -> tuple[str, str]:
    group = entry.get("process_group")
    if isinstance(group, (list, tuple)) and group:
        name = str(group[0])
        desc = str(group[1]) if len(group) > 1 else ""
        return name, desc
    return str(entry.get("pg_id", "?")), ""


def _members(dumps: dict[int, dict[str, Any]], name: str) -> list[int] | None:
    for dump in dumps.values():
        config = dump.get("pg_config")
        if isinstance(config, dict) and isinstance(config.get(name), dict):
            ranks = config[name].get("ranks")
            try:
                parsed = ast.literal_eval(ranks) if isinstance(ranks, str) else ranks
            except (ValueError, SyntaxError):
                continue
            if isinstance(parsed, (list, tuple)) and all(isinstance(r, int) for r in parsed):
                return sorted(parsed)
    return None


def summarise(dumps: dict[int, dict[str, Any]], errors: list[str] | None = None) -> Summary:
    """dumps: {global rank: loaded dump}."""
    groups: dict[tuple[str, str], dict[int, RankInGroup]] = {}
    for rank, dump in dumps.items():
        for entry in dump.get("entries") or []:
            if not isinstance(entry, dict) or entry.get("is_p2p"):
                continue  # point-to-point ops have their own numbering
            seq = entry.get("collective_seq_id")
            if not isinstance(seq, int) or seq <= 0:
                continue
            key = _group_key(entry)
            state = groups.setdefault(key, {}).setdefault(rank, RankInGroup(rank, 0, 0))
            state.entries[seq] = entry
            state.issued = max(state.issued, seq)
            if entry.get("state") == "completed":
                state.completed = max(state.completed, seq)
    findings: list[Finding] = []
    absent: set[int] = set()
    for (name, desc), by_rank in sorted(groups.items()):
        label = f"{name} ({desc})" if desc else name
        members = _members(dumps, name) or sorted(by_rank)
        # A member that dumped but never used this group has issued nothing in it.
        for rank in members:
            if rank in dumps and rank not in by_rank:
                by_rank[rank] = RankInGroup(rank, 0, 0)
        absent |= {r for r in members if r not in dumps}
        present = [by_rank[r] for r in members if r in by_rank]
        if not present:
            continue
        furthest = max(s.issued for s in present)
        behind = [s for s in present if s.issued < furthest]
        if behind:
            first = min(s.issued for s in behind) + 1
            missed = [s.rank for s in behind if s.issued == first - 1]
            reached = [s for s in present if s.issued >= first]
            entry = next((s.entries[first] for s in reached if first in s.entries), {})
            waiting = [s.rank for s in reached if s.completed < first]
            findings.append(
                Finding(label, first, _op(entry), "missed", missed, waiting=sorted(waiting))
            )
        findings += _mismatches(label, present)
        if not behind:
            stuck = [s.rank for s in present if s.completed < furthest]
            if stuck:
                entry = next((s.entries[furthest] for s in present if furthest in s.entries), {})
                findings.append(Finding(label, furthest, _op(entry), "stuck", sorted(stuck)))
    return Summary(sorted(dumps), findings, sorted(absent), list(errors or []))


def _op(entry: dict[str, Any]) -> str:
    return str(entry.get("profiling_name") or "an unknown operation")


def _mismatches(label: str, present: list[RankInGroup]) -> list[Finding]:
    """The first collective number whose members issued different ops or sizes."""
    common = set.intersection(*(set(s.entries) for s in present)) if present else set()
    for seq in sorted(common):
        ops = {s.rank: _op(s.entries[seq]) for s in present}
        sizes = {s.rank: repr(s.entries[seq].get("input_sizes")) for s in present}
        op = ops[present[0].rank]
        for differ, what in (
            (ops, "the ranks issued different collectives"),
            (sizes, f"{op} with different input sizes"),
        ):
            if len(set(differ.values())) > 1:
                said = ", ".join(f"rank {r}: {v}" for r, v in sorted(differ.items()))
                name = "/".join(sorted(set(ops.values())))  # (one op, when only sizes differ)
                detail = f"{what} ({said})"
                return [Finding(label, seq, name, "mismatch", sorted(differ), detail=detail)]
    return []


def summarise_files(files: dict[int, bytes]) -> Summary:
    """{rank: the dump's bytes} -> Summary; unreadable dumps are named, not fatal."""
    dumps, errors = {}, []
    for rank, data in sorted(files.items()):
        try:
            dumps[rank] = load_dump(data)
        except DumpError as exc:
            errors.append(f"rank {rank}'s dump could not be read: {exc}")
    return summarise(dumps, errors)
