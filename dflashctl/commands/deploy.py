"""dflashctl deploy: sync the trainer, stop stale runs, launch, follow the log."""

from __future__ import annotations

import shlex
from typing import Annotated, Any

import typer

from dflashctl.commands.common import (
    ConfigOption,
    DetachOption,
    FreshOption,
    JsonOption,
    TrainerArgsArgument,
    WaitOption,
)
from dflashctl.config.schema import load_config
from dflashctl.ui import terminal


def deploy(
    trainer_args: TrainerArgsArgument = None,
    config: ConfigOption = None,
    detach: DetachOption = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the plan (files to send, runs to stop, command); change nothing.",
        ),
    ] = False,
    start_container: Annotated[
        bool, typer.Option("--start-container", help="Start the container if it is stopped.")
    ] = False,
    fresh: FreshOption = False,
    wait: WaitOption = False,
    yes: Annotated[
        bool,
        typer.Option(
            "--yes",
            "-y",
            help="Send more than trainer.confirm_above_mb without asking (needed off a terminal).",
        ),
    ] = False,
    json_output: JsonOption = False,
) -> None:
    """Send the changed trainer files, stop stale runs, launch and follow the new run.

    With --detach it returns once the run started: every node's log shows the trainer's
    start line (every rank past the rendezvous; run.start_line). Exit 0 then; exit 1 with
    the crash named when the run died first; exit 0 with a warning when the line has not
    come after run.start_timeout_s (300 s; the run goes on). A trainer that prints no
    start line (no run.start_line, no DFLASH_START_GATE in its entry script) is not
    waited for.
    """
    from dflashctl.ops.deploy import DeployOptions
    from dflashctl.ops.deploy import deploy as run_deploy

    if json_output:
        terminal.set_quiet_stdout(True)
    cfg = load_config(config)
    options = DeployOptions(
        detach=detach,
        dry_run=dry_run,
        start_container=start_container,
        fresh=fresh,
        wait=wait,
        yes=yes,
        extra_args=list(trainer_args or []),
    )
    code, summary = run_deploy(cfg, options, terminal.TerminalReporter())
    if dry_run:
        show_plan(summary)
    if json_output:
        terminal.print_json(summary, command="deploy")
    if code:
        raise typer.Exit(code)


def show_plan(summary: dict[str, Any]) -> None:
    """The dry run's answer (deploy_plan.dry_run_summary), on stdout: each node's plan,
    headed by its node when there are several."""
    from dflashctl.humanize import human_bytes
    from dflashctl.ops.launching import describe_start, describe_target_to_stop
    from dflashctl.remote.nodes import names_each_node

    entries = summary["nodes"]
    out = terminal.out
    for entry in entries:
        if names_each_node(entries):
            out.print(
                f"[bold]node {entry['node']} ({entry['target']})[/bold] "
                f"(node rank {entry['node_rank']})"
            )
        out.print(f"[bold]plan[/bold] (dry run, nothing changed) for {entry['workdir']}")
        sending, removed = entry["files_to_send"], entry["files_removed"]
        if entry["release"]:
            out.print(
                f"  new release {entry['release']}: send {len(sending)} of "
                f"{entry['files_total']} files ({human_bytes(entry['bytes_to_send'])})"
                + (f", drop {len(removed)}" if removed else "")
            )
            for item in sending:
                out.print(f"    + {item['path']}  ({human_bytes(item['size'])})")
            for rel in removed:
                out.print(f"    - {rel}")
        else:
            out.print(f"  no changes: release {entry['previous_release']} stays (nothing sent)")
        if entry["runs_to_stop"]:
            out.print(f"  stop (SIGTERM, {entry['stop_grace_s']:g} s grace, then SIGKILL):")
            for item in entry["runs_to_stop"]:
                out.print(f"    {describe_target_to_stop(item)}")
        else:
            out.print("  nothing to stop")
        if entry["setup"]:
            out.print(f"  setup (in a venv, once per content): {'; '.join(entry['setup'])}")
        out.print(f"  launch in {entry['workdir']}/current: {shlex.join(entry['command'])}")
        start = describe_start(
            entry["continues"],
            entry["replaces_run"],
            fresh=entry["fresh"],
            train_steps=entry.get("train_steps"),
        )
        out.print(f"  the new run {start}")


def register(app: typer.Typer) -> None:
    app.command(context_settings={"allow_interspersed_args": False})(deploy)
