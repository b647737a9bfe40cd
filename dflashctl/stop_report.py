"""What a failed launch across nodes stopped, node by node, for its error message.

A launch stops each node's old run and starts the new one on every node at once. When
one node fails (no space for the run's folder, say), the others may already have
stopped their old run; the failed node's own sentence ("nothing was stopped") is only
true of that node. The error says, for every node, what was stopped there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflashctl.stopping import describe_stopped

_NOTHING = "; nothing was stopped"


def stopped_by_node(
    outcomes: Sequence[Any], run_id: str, stopped_again: dict[str, bool]
) -> list[str]:
    """One line per node: the old runs its launch stopped, and whether the new run
    that started there was stopped again (`stopped_again`: node name -> stopped)."""
    lines = []
    for outcome in outcomes:
        name = outcome.node.name
        if outcome.error is not None:
            message = str(getattr(outcome.error, "message", outcome.error))
            said = "nothing was stopped" if _NOTHING in message else "as its error says"
            lines.append(f"{name}: {said}")
            continue
        old = [describe_stopped(item) for item in outcome.value.get("stopped") or []]
        text = "; ".join(old) if old else "no run was running, nothing was stopped"
        if stopped_again.get(name):
            text += f"; then run {run_id}, which it had started, was stopped again"
        else:
            text += f"; run {run_id} it started may still run: `dflashctl stop` stops it"
        lines.append(f"{name}: {text}")
    return lines


def with_stops(message: str, lines: list[str]) -> str:
    """The failed node's message without its own "nothing was stopped", then what was
    stopped on each node."""
    head = message.replace(_NOTHING, "")
    return head + "\nwhat was stopped, node by node:\n" + "\n".join(f"  {line}" for line in lines)
