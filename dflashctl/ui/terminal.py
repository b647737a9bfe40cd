"""One terminal facade over rich: results on stdout, diagnostics on stderr.

Colour and progress bars appear only on an interactive terminal; NO_COLOR is
honoured by rich itself. Commands print through this module so that `--json`
output on stdout is never mixed with progress or step lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from rich.console import Console
from rich.markup import escape

from dflashctl.humanize import human_bytes, human_duration  # noqa: F401 - for the commands
from dflashctl.reporting import Reporter

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


_json_mode = False  # --json: no progress reports on top of the step lines


def set_quiet_stdout(quiet: bool) -> None:
    """With --json, everything human goes to stderr so stdout stays parseable."""
    global out, _json_mode
    out = err if quiet else Console(highlight=False, soft_wrap=True)
    _json_mode = quiet


_json_printed = False


def print_json(data: dict, *, command: str, node: str | None = None) -> None:
    """The one JSON object of `--json`, in the shape of ui/json_output.py (schema_version,
    nodes, run-level keys), on one line of the real stdout (everything human went to
    stderr), flushed so that a script reading it sees it at once. `node`: the one node's
    name when `data` is one node's answer."""
    from dflashctl.ui.json_output import document

    _write_json(document(command, data, node))


def _write_json(data: dict) -> None:
    global _json_printed
    _json_printed = True
    sys.stdout.write(json.dumps(data, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def print_json_error(
    message: str,
    exit_code: int,
    hint: str | None = None,
    command: str | None = None,
    nodes: list[dict] | None = None,
) -> None:
    """A `--json` command that failed still answers with one JSON object on stdout
    (unless it already printed its own); `nodes`: what each node left, when known."""
    from dflashctl.ui.json_output import error_document

    if not _json_printed:
        _write_json(error_document(message, exit_code, hint, command, nodes))


_quiet = False  # -q: no step, info or success lines (errors, warnings and results stay)
# -v: a shown command's arguments are cut to this many characters (the agent's
# bootstrap is a program of its own).
TRACE_ARG_CHARS = 80


def set_verbosity(*, quiet: bool, verbose: bool) -> None:
    global _quiet
    _quiet = quiet and not verbose


def command_ran(where: str, argv: Sequence[str]) -> None:
    """`dflashctl -v`: one dim line per command run over SSH or on this machine (a
    `pct exec` in it is the command run in the container)."""
    shown = []
    for arg in argv:
        if len(arg) > TRACE_ARG_CHARS or "\n" in arg:
            first = arg.splitlines()[0] if arg.strip() else arg
            shown.append(f"{first[:TRACE_ARG_CHARS]}… ({len(arg)} chars)")
        else:
            shown.append(arg)
    host = "this machine" if where == "local" else where
    err.print(f"[dim]$ ({escape(host)}) {escape(shlex.join(shown))}[/dim]")


def interactive() -> bool:
    return err.is_terminal and os.environ.get("TERM") != "dumb"


def info(message: str) -> None:
    if not _quiet:
        err.print(message)


def success(message: str) -> None:
    if not _quiet:
        err.print(f"[green]✓[/green] {message}")


def warning(message: str) -> None:
    err.print(f"[yellow]![/yellow] {message}")


def error(message: str, hint: str | None = None) -> None:
    err.print(f"[bold red]error:[/bold red] {escape(message)}")
    if hint:
        err.print(f"  [dim]hint:[/dim] {escape(hint)}")


def step_done(message: str, seconds: float) -> None:
    """One line per finished step, with its time: `✓ synced 3 files (12 KiB)  0.21 s`."""
    if _quiet:
        return
    err.print(f"[green]✓[/green] {message}  [dim]{seconds:.2f} s[/dim]")


@contextlib.contextmanager
def step(message: str) -> Iterator[dict]:
    """Time a step; the caller may replace the finished line via `result["done"]`.

    On a terminal a spinner shows while the step runs; elsewhere nothing is
    printed until the step finishes, so logs stay one line per step.
    """
    result: dict = {"done": message}
    start = time.monotonic()
    with spinner(message):
        yield result
    step_done(result["done"], time.monotonic() - start)


# A terminal has one live line: the spinner that holds this lock draws; one asked for
# while it does (a node's work in its thread, under the command's own) shows nothing.
_live_line = threading.Lock()


@contextlib.contextmanager
def spinner(message: str) -> Iterator[None]:
    """A spinner while something runs, on a terminal only (elsewhere nothing, so that
    logs stay one line per step), unless another one is already live."""
    if _quiet or not interactive() or not _live_line.acquire(blocking=False):
        yield
        return
    try:
        with err.status(message):
            yield
    finally:
        _live_line.release()


# Off a terminal, a transfer reports itself at most this often (a log stays short).
PLAIN_PROGRESS_EVERY_S = 5.0


@contextlib.contextmanager
def transfer(total: int, message: str, then: str) -> Iterator[Callable[[int], None]]:
    """Report a transfer of `total` bytes; yields `sent(n)`, callable from any thread.

    On a terminal: a progress bar with bytes, rate and time left, then a spinner with
    `then` (what the other side does once everything has arrived). Elsewhere: a plain
    line every PLAIN_PROGRESS_EVERY_S seconds. With --json: nothing.
    """
    if _json_mode:
        yield lambda n: None
    elif interactive():
        with _progress_bar(total, message, then) as sent:
            yield sent
    else:
        yield PlainProgress(total, message).sent


@contextlib.contextmanager
def _progress_bar(total: int, message: str, then: str) -> Iterator[Callable[[int], None]]:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(message, total=total)

        def sent(n: int) -> None:
            bar.advance(task, n)
            if bar.tasks[0].completed >= total:
                bar.update(task, description=then)

        yield sent


class PlainProgress:
    """`  sending 3 files: 120.0 MiB of 1.0 GiB (12%), 95.1 MiB/s, 9 s left`, at most
    every `every` seconds, for logs and pipes."""

    def __init__(
        self,
        total: int,
        message: str,
        *,
        every: float = PLAIN_PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.message = message
        self.every = every
        self.clock = clock
        self.done = 0
        self.started = self.last = clock()

    def sent(self, n: int) -> None:
        self.done += n
        now = self.clock()
        if now - self.last < self.every or self.done >= self.total:
            return
        self.last = now
        rate = self.done / max(now - self.started, 1e-9)
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        percent = 100 * self.done // max(self.total, 1)
        err.print(
            f"  {self.message}: {human_bytes(self.done)} of {human_bytes(self.total)} "
            f"({percent}%), {human_bytes(int(rate))}/s, {human_duration(round(left))} left",
            markup=False,
        )


class TerminalReporter(Reporter):
    """What the logic says (reporting.py), drawn here: step lines with their time,
    spinners and progress bars on a terminal, plain lines elsewhere, nothing extra on
    stdout under --json."""

    # This module's functions, the same for the logic as for the commands.
    step = staticmethod(step)
    done = staticmethod(step_done)
    info = staticmethod(info)
    warning = staticmethod(warning)
    busy = staticmethod(spinner)
    transfer = staticmethod(transfer)

    def output(self, label: str, line: str) -> None:
        prefix = f"[dim]{escape(label + ' ' if label else '')}setup |[/dim] "
        out.print(prefix + escape(line), soft_wrap=True, highlight=False)

    def confirm(self, question: str) -> bool | None:
        if not (sys.stdin.isatty() and interactive()):
            return None
        import typer

        return typer.confirm(question, err=True)
