"""A node's failure as data: for --json, for a line of text, and as the one error a
command raises once every node that answered was reported.

The failed node's own error is never rewritten: `NodesFailed` carries it, with the
node's name and place, and says them in its own message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflashctl.errors import EXIT_HOST, DflashError
from dflashctl.remote.nodes import NodeOutcome


def error_json(error: BaseException | None) -> dict[str, Any] | None:
    """A node's failure for --json: its message and hint (None when it answered)."""
    if error is None:
        return None
    if isinstance(error, DflashError):
        return {"message": error.message, "hint": error.hint}
    return {"message": str(error) or type(error).__name__, "hint": None}


def error_text(error: BaseException | None) -> str:
    if isinstance(error, DflashError):
        return error.message
    return str(error) or type(error).__name__


class NodesFailed(DflashError):
    """One node (the first of those that failed) failed a step, of several nodes; the
    exit code is its error's."""

    def __init__(self, node: str, place: str, step: str, cause: BaseException, others: list[str]):
        self.node, self.place, self.step, self.cause, self.others = node, place, step, cause, others
        self.exit_code = cause.exit_code if isinstance(cause, DflashError) else EXIT_HOST
        also = f" (also failed: {', '.join(others)})" if others else ""
        doing = f" {step}" if step else ""
        hint = cause.hint if isinstance(cause, DflashError) else None
        super().__init__(f"node {node} ({place}){doing}: {error_text(cause)}{also}", hint=hint)


def first_failure(outcomes: Sequence[NodeOutcome[Any]], step: str = "") -> BaseException | None:
    """The error to raise after the report: None when every node answered; one node's
    own error as it is; of several, the first failure as NodesFailed (naming the others
    that failed too)."""
    failed = [o for o in outcomes if o.error is not None]
    if not failed:
        return None
    first = failed[0]
    assert first.error is not None
    if len(outcomes) == 1 or not isinstance(first.error, DflashError):
        return first.error  # a bug's own exception keeps its traceback
    return NodesFailed(
        first.node.name,
        first.node.target.describe(),
        step,
        first.error,
        [o.node.name for o in failed[1:]],
    )


def nobody_answered(outcomes: Sequence[NodeOutcome[Any]]) -> bool:
    """Every node failed: the command answers like one that failed before any node did
    (the error's own --json answer), not with a list of failed nodes."""
    return all(o.error is not None for o in outcomes)
