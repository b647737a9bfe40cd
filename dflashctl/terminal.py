"""One terminal facade over rich: results on stdout, diagnostics on stderr.

Colour and progress bars appear only on an interactive terminal; NO_COLOR is
honoured by rich itself. Commands print through this module so that `--json`
output on stdout is never mixed with progress or step lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def set_quiet_stdout(quiet: bool) -> None:
    """With --json, everything human goes to stderr so stdout stays parseable."""
    global out
    out = err if quiet else Console(highlight=False, soft_wrap=True)


_json_printed = False


def print_json(data: object, *, indent: int | None = None) -> None:
    """The one JSON object of `--json`, on the real stdout (everything human went to
    stderr), flushed so that a script reading it sees it at once."""
    global _json_printed
    _json_printed = True
    sys.stdout.write(json.dumps(data, indent=indent) + "\n")
    sys.stdout.flush()


def print_json_error(message: str, exit_code: int, hint: str | None = None) -> None:
    """A `--json` command that failed still answers with one JSON object on stdout
    (unless it already printed its own)."""
    if not _json_printed:
        print_json({"error": message, "exit_code": exit_code, "hint": hint})


def interactive() -> bool:
    return err.is_terminal and os.environ.get("TERM") != "dumb"


def info(message: str) -> None:
    err.print(message)


def success(message: str) -> None:
    err.print(f"[green]✓[/green] {message}")


def warning(message: str) -> None:
    err.print(f"[yellow]![/yellow] {message}")


def error(message: str, hint: str | None = None) -> None:
    err.print(f"[bold red]error:[/bold red] {escape(message)}")
    if hint:
        err.print(f"  [dim]hint:[/dim] {escape(hint)}")


def step_done(message: str, seconds: float) -> None:
    """One line per finished step, with its time: `✓ synced 3 files (12 KiB)  0.21 s`."""
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


def spinner(message: str) -> contextlib.AbstractContextManager:
    """A spinner while something runs, on a terminal only (elsewhere nothing, so that
    logs stay one line per step)."""
    return err.status(message) if interactive() else contextlib.nullcontext()


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def human_duration(seconds: int) -> str:
    """`3d 4h`, `2h 05m`, `4m 09s`, `12s`: an uptime at the precision that matters."""
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"
