"""dflashctl stacks: every thread's Python stack of a live run, per rank."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape

from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.errors import UsageError
from dflashctl.ui import terminal


def stacks(
    run_id: Annotated[
        str | None, typer.Argument(help="The run (default: the active run).", show_default=False)
    ] = None,
    config: ConfigOption = None,
    wait: Annotated[
        float,
        typer.Option("--wait", help="Seconds to wait for every rank to answer."),
    ] = 10.0,  # a rank busy in a long C call (a CPU step) answers once its GIL is free
    json_output: JsonOption = False,
) -> None:
    """Ask a live run for every thread's stack (each rank under torchrun), and show what
    its hang watchdog and the NCCL flight recorder dumped: where a hanging run is stuck."""
    from dflashctl.config.schema import load_config
    from dflashctl.ops.stacks import analyse_together, stacks_of_every_node
    from dflashctl.remote.nodes import error_json, fleet_failure, names_each_node, nobody_answered

    if not wait > 0:
        raise UsageError(f"--wait must be more than 0 seconds, got {wait:g}")
    if json_output:
        terminal.set_quiet_stdout(True)
    outcomes = stacks_of_every_node(load_config(config), run_id, wait)
    failure = fleet_failure(outcomes, "asking for stacks")
    if failure is not None and nobody_answered(outcomes):
        raise failure
    analysis = analyse_together(outcomes)  # every node's ranks as one job
    if json_output:
        # A node that did not answer, in the shape of one that did.
        unanswered = {"run_id": run_id or "", "status": "unknown", "answers": [], "missing": []}
        entries = [
            {"node": o.node.name, **(o.value or unanswered), "error": error_json(o.error)}
            for o in outcomes
        ]
        terminal.print_json({"nodes": entries, "analysis": analysis}, command="stacks")
    else:
        several = names_each_node(outcomes)
        for outcome in outcomes:
            if outcome.value is not None:
                print_answer(outcome.value, outcome.node.name if several else None)
        print_analysis(analysis)
    if failure is not None:
        raise failure


# Frames shown per thread, innermost last (the full stacks stay in --json).
SHOWN_FRAMES = 12


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
    stopped = answer.get("stopped") or {}
    for rank in answer["missing"]:
        pid = stopped.get(str(rank))
        if pid is not None:
            terminal.warning(
                f"rank {rank} did not answer: its process (pid {pid}) is stopped (state T: "
                f"SIGSTOP, Ctrl-Z or a debugger), so it runs nothing at all; continue it with "
                f"`kill -CONT {pid}` in the container"
            )
            continue
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


def print_analysis(analysis: dict[str, Any]) -> None:
    """Every rank of every node as one job: who is behind, at which collective, doing what."""
    out = terminal.out
    if not analysis["ranks"] and not analysis["flight_recorder"]:
        return
    nodes = sorted({str(r["node"]) for r in analysis["ranks"] if r.get("node")})
    out.print(
        f"[bold]every rank together[/bold] ({len(analysis['ranks'])} ranks"
        + (f" on nodes {', '.join(map(escape, nodes))}" if nodes else "")
        + ")"
    )
    for line in analysis["said"] or [analysis["why"]]:
        out.print(f"  {escape(line)}")
    recorder = analysis["flight_recorder"]
    if recorder:
        for line in recorder["summary"]:
            out.print(f"  flight recorder: {escape(line)}")


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


def register(app: typer.Typer) -> None:
    app.command()(stacks)
