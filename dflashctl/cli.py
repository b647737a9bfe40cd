"""The dflashctl command line: a typer app whose commands live in dflashctl/commands/.

Kept light on purpose: `dflashctl --help` must start fast, so nothing heavy
(paramiko, torch) is imported here; command modules import what they need
inside their functions.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from dflashctl import __version__, terminal
from dflashctl.errors import EXIT_INTERRUPTED, DflashError
from dflashctl.json_output import command_in

# Order is the order of `dflashctl --help`.
COMMAND_MODULES = ("init", "doctor", "status", "deploy", "restart", "stop", "runs", "logs")

app = typer.Typer(
    name="dflashctl",
    help="Deploy, run and debug DFlash drafter training in Proxmox containers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dflashctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Deploy, run and debug DFlash drafter training in Proxmox containers."""


def _register_commands() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(f"dflashctl.commands.{name}").register(app)


_register_commands()


def _wants_json(argv: list[str]) -> bool:
    """Was --json given to dflashctl (not among the trainer's arguments after `--`)?"""
    mine = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in mine


def main() -> None:
    debug = os.environ.get("DFLASHCTL_DEBUG") == "1"
    as_json = _wants_json(sys.argv[1:])
    try:
        # Without standalone mode, click returns a `typer.Exit(code)` raised by a command.
        code = app(standalone_mode=False)
    except DflashError as exc:
        terminal.error(exc.message, exc.hint)
        if as_json:
            terminal.print_json_error(
                exc.message, exc.exit_code, exc.hint, command_in(sys.argv[1:])
            )
        if debug:
            raise
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        terminal.err.print("[yellow]interrupted[/yellow]")
        if as_json:
            terminal.print_json_error(
                "interrupted", EXIT_INTERRUPTED, command=command_in(sys.argv[1:])
            )
        sys.exit(EXIT_INTERRUPTED)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        terminal.err.print("[yellow]aborted[/yellow]")
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:  # click usage errors arrive here in non-standalone mode
        # typer vendors click (typer._click), so match click's exception by its interface.
        if callable(getattr(exc, "show", None)) and hasattr(exc, "exit_code"):
            exc.show()
            if as_json:
                message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
                terminal.print_json_error(message, 2, "see --help", command_in(sys.argv[1:]))
            sys.exit(2)
        raise
    if isinstance(code, int) and code:
        sys.exit(code)
