"""CrashEvent: one failure found in a run's log."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CrashEvent:
    rule: str
    category: str
    severity: str
    retryable: bool
    hint: str
    line: int  # 1-based line of the log where the failure starts
    end_line: int
    thread: str | None = None
    device: str | None = None
    stage: str | None = None
    exception: str | None = None  # exception type, e.g. "torch.OutOfMemoryError"
    message: str | None = None  # the exception's message (first line), or the matched line
    last_frame: str | None = None  # innermost frame, "path:line in function"
    excerpt: list[str] = field(default_factory=list)
    is_root_cause: bool = False
    # Where in a distributed run: the global rank, torchrun's local rank, the node (its
    # name in dflash.yaml, else its node rank) and host, as far as the log tells.
    rank: int | None = None
    local_rank: int | None = None
    node: str | None = None
    host: str | None = None
    pid: int | None = None
    details: dict[str, Any] = field(default_factory=dict)  # the category's particulars

    @classmethod
    def of_rule(cls, rule: Any, line: int, end_line: int | None = None, **found: Any) -> CrashEvent:
        """An event named by `rule` (crash/rules.py's Rule), starting at log line `line`."""
        return cls(
            rule=rule.name,
            category=rule.category,
            severity=rule.severity,
            retryable=rule.retryable,
            hint=rule.hint,
            line=line,
            end_line=line if end_line is None else end_line,
            **found,
        )

    @property
    def where(self) -> str:
        """`rank 1 (local rank 1) on node gpu-b, host gpu-b`; empty for one process."""
        parts = []
        if self.rank is not None:
            local = f" (local rank {self.local_rank})" if self.local_rank is not None else ""
            parts.append(f"rank {self.rank}{local}")
        elif self.local_rank is not None:
            parts.append(f"local rank {self.local_rank}")
        if self.node:
            parts.append(f"node {self.node}")
        if self.host and self.host != self.node:
            parts.append(f"host {self.host}")
        return ", ".join(parts)

    def fill_from(self, source) -> None:
        """Local rank, host and pid from what else the log said of its rank (a RankInfo,
        torchrun's TorchrunFailure), where the event does not say them itself."""
        self.local_rank = source.local_rank if self.local_rank is None else self.local_rank
        self.host = self.host or source.host
        self.pid = self.pid or source.pid

    @property
    def summary(self) -> str:
        """One line: what failed, as a user would say it."""
        what = self.exception or self.category
        if self.message:
            what = f"{what}: {self.message}" if self.exception else self.message
        return what

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "category": self.category,
            "thread": self.thread,
            "device": self.device,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "node": self.node,
            "host": self.host,
            "pid": self.pid,
            "stage": self.stage,
            "exception": self.exception,
            "message": self.message,
            "line": self.line,
            "hint": self.hint,
            "excerpt": list(self.excerpt),
            "last_frame": self.last_frame,
            "severity": self.severity,
            "retryable": self.retryable,
            "root_cause": self.is_root_cause,
            "details": dict(self.details),
        }
