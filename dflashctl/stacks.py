"""`dflashctl stacks`: a live run's threads, per rank, as its trainer dumps them
(trainer/dflash/pipeline/stacks.py), with what its watchdog and the NCCL flight
recorder left (the agent's `stacks` verb, dflashctl/agent/stacks.py)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from rich.markup import escape

from dflashctl import flight_recorder, terminal
from dflashctl.agent_client import call_agent

# The trainer polls for a request every 0.2 s; a rank busy in a long C call (a whole
# step on the CPU) answers once its GIL is free again.
DEFAULT_WAIT_S = 10.0
# Frames shown per thread, innermost last (the full stacks stay in --json).
SHOWN_FRAMES = 12


def ask_stacks(target: Any, config: Any, run_id: str | None, wait_s: float) -> dict[str, Any]:
    """One node's answer, with its flight recorder dumps summarised."""
    answer = call_agent(
        target,
        config.container.python,
        "stacks",
        {"workdir": config.container.workdir, "run_id": run_id, "wait_s": wait_s},
        timeout=wait_s + 60,
    )
    answer["where"] = target.describe()
    answer["flight_recorder_summary"] = summarise_dumps(answer.get("flight_recorder") or [])
    for dump in answer.get("flight_recorder") or []:
        dump.pop("data", None)  # the pickles themselves stay in the run folder
    return answer


def summarise_dumps(dumps: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not dumps:
        return None
    files, errors = {}, []
    for dump in dumps:
        if dump.get("too_big"):
            errors.append(
                f"rank {dump['rank']}'s dump ({dump['bytes']} bytes) is too big to read here"
            )
            continue
        try:
            files[int(dump["rank"])] = base64.b64decode(dump.get("data") or "")
        except (binascii.Error, ValueError):
            errors.append(f"rank {dump['rank']}'s dump came garbled")
    summary = flight_recorder.summarise_files(files)
    summary.errors += errors
    return summary.to_json()


def print_answer(answer: dict[str, Any], node: str | None = None) -> None:
    out = terminal.out
    where = f"node {node}, " if node else ""
    out.print(
        f"[bold]run {escape(answer['run_id'])}[/bold] ({where}{escape(answer['where'])}): "
        f"{escape(answer['status'])}"
    )
    for dump in answer["answers"]:
        _print_dump(dump, "asked now")
    if answer["status"] == "running" and not answer["asked"]:
        terminal.warning(
            "no rank of this run said it can be asked (its trainer predates `stacks`, or it "
            "has not started yet)"
        )
    for rank in answer["missing"]:
        terminal.warning(
            f"rank {rank} did not answer: its Python is blocked with the GIL held; "
            f"`kill -USR1` it for a C-level dump into {answer['run_dir']}/stacks/"
            f"rank{rank}.faulthandler.txt"
        )
    for dump in answer["watchdog"]:
        silent = dump.get("silent_s")
        _print_dump(
            dump,
            f"by its watchdog after {silent:g} s without a step" if silent else "by its watchdog",
        )
    summary = answer.get("flight_recorder_summary")
    if summary:
        out.print(
            "[bold]NCCL flight recorder[/bold] (ranks "
            + ", ".join(map(str, summary["ranks"]))
            + ")"
        )
        for line in summary["summary"]:
            out.print(f"  {escape(line)}")
    if not answer["answers"] and not answer["watchdog"] and answer["status"] != "running":
        terminal.info("the run is not running and left no stacks")


def _print_dump(dump: dict[str, Any], how: str) -> None:
    out = terminal.out
    step = dump.get("last_step")
    at = f", after step {step}/{dump.get('total_steps')}" if step is not None else ""
    out.print(
        f"[bold cyan]rank {dump.get('rank')}[/bold cyan] (pid {dump.get('pid')} on "
        f"{escape(str(dump.get('host')))}{at}): {len(dump.get('threads') or [])} threads, {how}"
    )
    for thread in dump.get("threads") or []:
        frames = thread.get("frames") or []
        out.print(f"  [bold]{escape(str(thread.get('name')))}[/bold]")
        if len(frames) > SHOWN_FRAMES:
            out.print(f"    [dim]... {len(frames) - SHOWN_FRAMES} outer frames[/dim]")
        for frame in frames[-SHOWN_FRAMES:]:
            out.print(
                f"    {escape(str(frame.get('file')))}:{frame.get('line')} in "
                f"[bold]{escape(str(frame.get('function')))}[/bold]",
                highlight=False,
            )
            if frame.get("code"):
                out.print(f"      [dim]{escape(frame['code'])}[/dim]", highlight=False)
