"""What the fleet commands say about a node that failed, in text and in --json."""

from __future__ import annotations

from typing import Any

from dflashctl.errors import DflashError
from dflashctl.nodes import NodeOutcome, values_or_raise


def error_json(error: BaseException | None) -> dict[str, Any] | None:
    """A node's failure for --json: its message and hint (None when it answered)."""
    if error is None:
        return None
    if isinstance(error, DflashError):
        return {"message": error.message, "hint": error.hint}
    return {"message": str(error) or type(error).__name__, "hint": None}


def error_text(error: BaseException) -> str:
    return error.message if isinstance(error, DflashError) else str(error)


def first_failure(outcomes: list[NodeOutcome[Any]], what: str = "") -> BaseException | None:
    """The first node's failure, its message naming that node (and the others that
    failed too), to raise once every node that answered was reported; None if none."""
    try:
        values_or_raise(outcomes, what)
    except Exception as exc:  # raised by the caller, after its report
        return exc
    return None
