"""dflashctl pull: copy a run's checkpoint, serving export and metrics here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.commands.run_ids import complete_run_id


def pull(
    run_id: Annotated[
        str,
        typer.Argument(
            help="The run's id (`dflashctl runs` lists them).",
            metavar="RUN",
            autocompletion=complete_run_id,
        ),
    ],
    step: Annotated[
        int | None,
        typer.Option(
            "--step", help="The checkpoint of this step (default: the latest).", show_default=False
        ),
    ] = None,
    to: Annotated[
        Path | None,
        typer.Option(
            "--to",
            metavar="DIR",
            help="The local folder (default: ./runs/<run id>/).",
            show_default=False,
        ),
    ] = None,
    config: ConfigOption = None,
    json_output: JsonOption = False,
) -> None:
    """Copy a run's checkpoint, serving export and metrics to a local folder.

    The checkpoint is the latest or --step N's, with its drafter/ serving export; the
    metrics are metrics.jsonl, meta.json and TensorBoard files. Every file is checked
    by sha256, and a cut pull continues where it stopped."""
    from dflashctl.config.schema import load_config
    from dflashctl.errors import UsageError
    from dflashctl.ops import pull as pulling
    from dflashctl.remote.nodes import node_sessions
    from dflashctl.ui import terminal

    if step is not None and step < 0:
        raise UsageError(f"--step must be 0 or more, got {step}")
    if "/" in run_id or run_id in (".", ".."):
        raise UsageError(f"not a run id: {run_id!r}", hint="`dflashctl runs` lists the runs")
    if json_output:
        terminal.set_quiet_stdout(True)
    cfg = load_config(config)
    dest = (to if to is not None else Path("runs") / run_id).expanduser()
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"{dest} exists and is not a folder", hint="pass another --to")
    report = terminal.TerminalReporter()
    with node_sessions(cfg) as nodes:
        answers = pulling.plans(nodes, run_id, step, report)
        files, checkpoint = pulling.choose(nodes, answers, run_id, step)
        dest.mkdir(parents=True, exist_ok=True)
        counts = pulling.pull_files(files, dest, report)
    left_out = pulling.links_left_out(answers)
    if left_out:
        shown = ", ".join(left_out[:5]) + (
            f" and {len(left_out) - 5} more" if len(left_out) > 5 else ""
        )
        terminal.warning(
            f"links not pulled (pull copies files, never what a link points at): {shown}"
        )
    export = None
    if checkpoint:
        where = dest / "checkpoints" / checkpoint["name"]
        export = where / "drafter" if checkpoint.get("export") else None
        terminal.success(
            f"checkpoint of run {checkpoint['run_id']} at step {checkpoint['step']} in {where}"
        )
        if export:
            terminal.info(f"  serving export (Hugging Face format): {export}")
        else:
            terminal.info(
                "  no serving export in it (no drafter/ folder): it resumes training only"
            )
    else:
        terminal.warning(f"run {run_id} has no checkpoint yet: pulled its metrics only")
    terminal.info(
        f"  {len(files)} files verified by sha256 in {dest}: {counts['fetched']} fetched, "
        f"{counts['resumed']} resumed, {counts['already']} already there "
        f"({terminal.human_bytes(counts['bytes'])} moved)"
    )
    if json_output:
        terminal.print_json(
            {
                # The nodes the files came from (rank 0's node for the checkpoint).
                "nodes": [
                    {"node": name, "files": sum(1 for f in files if f.node.name == name)}
                    for name in dict.fromkeys(f.node.name for f in files)
                ],
                "run_id": run_id,
                "to": str(dest),
                "checkpoint": checkpoint,
                "export": str(export) if export else None,
                "files": [{"path": f.rel, "size": f.size, "sha256": f.sha256} for f in files],
                **counts,
            },
            command="pull",
        )


def register(app: typer.Typer) -> None:
    app.command()(pull)
