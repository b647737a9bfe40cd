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
        }
