"""What `runs` says of runs and of a prune, for one node (commands/runs.py) and for
several (fleet/runs.py) alike."""

from __future__ import annotations

import sys

import typer

from dflashctl import terminal
from dflashctl.errors import UsageError


def continues(meta: dict) -> str:
    """`<run>@<step>` for a run that continued another's training, `-` for step 0."""
    if not meta.get("resumed_from"):
        return "-"
    step = meta.get("resumed_step")
    return str(meta["resumed_from"]) + ("" if step is None else f"@{step}")


def confirm_prune(plan) -> bool:
    if not (sys.stdin.isatty() and terminal.interactive()):
        raise UsageError(
            f"--prune would remove {len(plan.removed)} run folders; nothing was removed",
            hint="add --yes to remove them, or --dry-run to only list them",
        )
    size = terminal.human_bytes(plan.bytes)
    return typer.confirm(f"remove {len(plan.removed)} runs ({size})?", err=True)


def show_prune_plan(plan, place: str, keep: int, *, dry: bool) -> None:
    """On stderr, like every human line: stdout stays free for --json."""
    if not plan.removed:
        spared = f" ({len(plan.spared)} older ones are active or running)" if plan.spared else ""
        terminal.info(f"nothing to prune: {plan.runs} runs on {place}, keeping {keep}{spared}")
        return
    verb = "would remove" if dry else "removed"
    for run in plan.removed:
        state = run["status"] + (f" {run['exit_code']}" if run.get("exit_code") is not None else "")
        terminal.info(f"  {run['id']}  {state:<10}  {terminal.human_bytes(int(run['bytes']))}")
    total = terminal.human_bytes(plan.bytes)
    message = f"{verb} {len(plan.removed)} of {plan.runs} runs ({total}) on {place}"
    if plan.spared:
        message += f"; kept {len(plan.spared)} older active or running ones"
    (terminal.info if dry else terminal.success)(message)
