"""dflashctl logs: a run's log, live with --follow, with its crashes named.

The run is followed on every node of the fleet at once (dflashctl/follow/fleet.py);
with several nodes in dflash.yaml, lines are prefixed with the node and the root cause
is the first failure in time: exit 1 when any node crashed, 3 when a node could not be
reached within --reconnect-timeout.

Exit codes: 0 the run is running or finished cleanly, 1 it crashed (a detected crash, a
non-zero exit or a signal; a crash found in the log of a run whose process still runs,
say a dead worker thread, counts too), 2 usage, 3 host/connection trouble, 130 Ctrl-C
(following stops; the run keeps going).

The following itself (streaming, reconnecting, the end of the run) is dflashctl.follow.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, BinaryIO

import typer

from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.commands.run_ids import complete_run_id
from dflashctl.errors import UsageError
from dflashctl.ui import terminal

DEFAULT_LINES = 50


def logs(
    run_id: Annotated[
        str | None,
        typer.Argument(
            help="The run (default: the active run, i.e. the one launched last).",
            show_default=False,
            autocompletion=complete_run_id,
        ),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", "-f", help="Keep printing until the run ends; exit 0 clean, 1 crash."
        ),
    ] = False,
    lines: Annotated[
        int, typer.Option("--lines", "-n", help="How many of the last lines to show first.", min=0)
    ] = DEFAULT_LINES,
    json_output: JsonOption = False,
    file: Annotated[
        str | None,
        typer.Option(
            "--file", help="Classify a local log instead (`-` reads stdin).", show_default=False
        ),
    ] = None,
    exit_code: Annotated[
        int | None,
        typer.Option(
            "--exit-code",
            help="With --file: the run's exit status, weighed too.",
            show_default=False,
        ),
    ] = None,
    reconnect_timeout: Annotated[
        float,
        typer.Option(
            "--reconnect-timeout",
            help="Seconds to keep reconnecting after a drop before giving up (exit 3).",
            min=0,
        ),
    ] = 120.0,
    config: ConfigOption = None,
) -> None:
    """Show a run's log and the crashes in it; --follow streams it until the run ends."""
    from dflashctl.follow import report_fleet, report_result

    if json_output:
        terminal.set_quiet_stdout(True)
    if file is not None:
        if run_id is not None or follow:
            raise UsageError("--file classifies a local log: it takes no RUN_ID and no --follow")
        result = _classify_file(file, exit_code, lines, config, show_lines=not json_output)
        raise typer.Exit(report_result(result, json_mode=json_output))  # a local file: no node
    if exit_code is not None:
        raise UsageError(
            "--exit-code goes with --file",
            hint="for a run, the exit code is read from the run itself",
        )
    followed = _follow(run_id, follow, lines, reconnect_timeout, config, json_output)
    raise typer.Exit(report_fleet(followed, json_mode=json_output))


def _follow(run_id, follow, lines, reconnect_timeout, config_path, json_output):
    from dflashctl.config.schema import load_config
    from dflashctl.crash import rules_for
    from dflashctl.follow import follow_fleet, resolve_run
    from dflashctl.remote.nodes import node_sessions

    config = load_config(config_path)
    rules = rules_for(config)  # a bad crash rule is a config error, before any contact
    with node_sessions(config) as nodes:
        return follow_fleet(
            nodes,
            resolve_run(nodes, run_id),
            rules=rules,
            follow=follow,
            lines=lines,
            # Scripts reading --json still see a followed run's progress, on stderr.
            show_lines=follow or not json_output,
            reconnect_timeout_s=reconnect_timeout,
            waiting_notice=not json_output,
        )


def _classify_file(path, exit_code, lines, config_path, *, show_lines):
    from dflashctl.follow import classify_log

    rules = _rules(config_path)
    if path == "-":
        source = contextlib.nullcontext(sys.stdin.buffer)
    else:
        try:
            source = Path(path).expanduser().open("rb")
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror}") from exc
    records = []
    if path != "-":
        from dflashctl.crash.error_files import read_error_files

        # A run folder copied whole: torchelastic's error files lie next to train.log.
        records = read_error_files(Path(path).expanduser().resolve().parent)
    with source as handle:
        return classify_log(
            _chunks(handle),
            rules=rules,
            exit_code=exit_code,
            lines=lines,
            name=path,
            show_lines=show_lines,
            error_files=records,
        )


def _rules(config_path: str | None) -> list:
    """The crash rules, with dflash.yaml's crash_patterns when there is a config: a
    copied log needs no config and no host."""
    from dflashctl.config.schema import find_config_path, load_config
    from dflashctl.crash import load_rules, rules_for

    if config_path is None and not find_config_path(None).is_file():
        return load_rules()
    return rules_for(load_config(config_path))


def _chunks(handle: BinaryIO) -> Iterator[bytes]:
    read = getattr(handle, "read1", handle.read)  # read1: what has arrived, for pipes
    while chunk := read(1 << 16):
        yield chunk


def register(app: typer.Typer) -> None:
    app.command()(logs)
