"""The dflashctl command line: a typer app whose commands live in dflashctl/commands/.

Kept light on purpose: `dflashctl --help` must start fast, so nothing heavy
(paramiko, torch) is imported here; command modules import what they need
inside their functions.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
import threading
from typing import Any

import typer

from dflashctl import __version__
from dflashctl.errors import EXIT_INTERRUPTED, DflashError
from dflashctl.ui import help, terminal
from dflashctl.ui.help import RootHelpGroup
from dflashctl.ui.json_output import command_in

# Order is the order of `dflashctl --help`.
COMMAND_MODULES = (
    "init",
    "doctor",
    "status",
    "deploy",
    "restart",
    "stop",
    "runs",
    "logs",
    "exec",
    "shell",
    "pull",
    "stacks",
    "container",
)

app = typer.Typer(
    name="dflashctl",
    no_args_is_help=True,
    # --install-completion / --show-completion (bash, zsh, fish, PowerShell).
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # dflashctl.ui.help formats the help itself
    cls=RootHelpGroup,
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
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="Say only errors, warnings and results (no step lines)."
    ),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        help="Also show each command run on the host (over SSH) and in the container.",
    ),
) -> None:
    """Deploy, run and debug DFlash drafter training in Proxmox containers.

    Every command reads dflash.yaml (--config, or $DFLASHCTL_CONFIG, or ./dflash.yaml);
    `dflashctl init` writes one to edit, and `dflashctl doctor` checks it end to end.
    """
    terminal.set_verbosity(quiet=quiet, verbose=verbose)
    _say_notices()
    if verbose:
        from dflashctl.remote.transport import base

        base.command_trace = terminal.command_ran


def _say_notices() -> None:
    """The logic's Notice warnings as the terminal's `!` lines; other warnings as Python
    shows them."""
    import warnings

    from dflashctl.errors import Notice

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, Notice):
            terminal.warning(str(message))
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


class CommandInterrupted(Exception):
    """Ctrl-C inside a command, carried past typer (which turns a KeyboardInterrupt
    into a silent exit 130) to main, which says it."""


def _saying_interrupts(callback):
    @functools.wraps(callback)
    def run(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except KeyboardInterrupt:
            raise CommandInterrupted() from None

    return run


def _wrap_commands(typer_app: typer.Typer, prefix: str = "") -> None:
    """Each command says Ctrl-C in one line, and has dflashctl.ui.help's help."""
    for command in typer_app.registered_commands:
        name = prefix + (command.name or command.callback.__name__)
        command.callback = _saying_interrupts(command.callback)
        command.cls = help.help_class(name, help.PlainHelpCommand)
        command.short_help = help.SHORT_HELP[name]
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            group.cls = help.help_class(group.name, help.PlainHelpGroup)
            group.short_help = help.SHORT_HELP[group.name]
            _wrap_commands(group.typer_instance, f"{group.name} ")
            callback = group.typer_instance.registered_callback
            if callback is not None and callback.callback is not None:
                callback.callback = _saying_interrupts(callback.callback)


for _name in COMMAND_MODULES:
    importlib.import_module(f"dflashctl.commands.{_name}").register(app)
_wrap_commands(app)


def _wants_json(argv: list[str]) -> bool:
    """Was --json given to dflashctl (not among the trainer's arguments after `--`)?"""
    mine = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in mine


def _sigint_raises(yes: bool) -> None:
    """Ctrl-C raises KeyboardInterrupt (the commands' own handling), or is ignored
    (while the last line is said). Only the main thread may set a handler."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler if yes else signal.SIG_IGN)


ROOT_FLAGS = ("-q", "--quiet", "-v", "--verbose")
CONFIG_OPTIONS = ("-c", "--config")
# `exec -n NODE` and `shell -n NODE` from before -n meant --lines everywhere (logs).
OLD_NODE_FLAG = {"exec": "-N", "shell": "-N"}


def common_options_anywhere(argv: list[str]) -> list[str]:
    """The command line with the common options where click wants them, so that either
    side of the command works: `-q`/`-v` given after the command move in front of it,
    `-c PATH` given before it moves after it (`dflashctl -c x.yaml pull` is `dflashctl
    pull -c x.yaml`, `dflashctl deploy -v` is `dflashctl -v deploy`). Nothing after `--`
    (the trainer's or the container command's arguments) is touched, nor what follows
    the first argument of a command that passes its arguments on (exec)."""
    end = argv.index("--") if "--" in argv else len(argv)
    mine, rest = argv[:end], argv[end:]
    front: list[str] = []
    config: list[str] = []
    at = 0
    while at < len(mine) and mine[at].startswith("-"):
        word = mine[at]
        if word in CONFIG_OPTIONS and at + 1 < len(mine):
            config += mine[at : at + 2]
            at += 2
            continue
        if word.startswith("--config="):
            config.append(word)
        else:
            front.append(word)
        at += 1
    # typer's own copy of click: its classes are known by what they have.
    command: Any = typer.main.get_command(app)
    words: list[str] = []
    while at < len(mine) and hasattr(command, "commands") and not mine[at].startswith("-"):
        found = command.commands.get(mine[at])
        if found is None:
            break
        words.append(mine[at])
        command = found
        at += 1
    if not words:
        return argv
    own = {opt for param in command.params for opt in getattr(param, "opts", [])}
    valued = {
        opt
        for param in command.params
        if param.param_type_name == "option" and not param.is_flag
        for opt in param.opts + param.secondary_opts
    }
    interspersed = command.context_settings.get("allow_interspersed_args", True)
    after: list[str] = []
    while at < len(mine):
        word = mine[at]
        if word in ROOT_FLAGS and word not in own:
            front.append(word)
        elif word == "-n" and words[-1] in OLD_NODE_FLAG and at + 1 < len(mine):
            after += [OLD_NODE_FLAG[words[-1]], mine[at + 1]]
            at += 1
        elif not word.startswith("-") and not interspersed:
            after += mine[at:]
            break
        else:
            after.append(word)
            if word in valued and at + 1 < len(mine):
                after.append(mine[at + 1])
                at += 1
        at += 1
    return [*front, *words, *config, *after, *rest]


def main() -> None:
    sys.argv[1:] = common_options_anywhere(sys.argv[1:])
    as_json = _wants_json(sys.argv[1:])
    try:
        # dflashctl.entry said an early Ctrl-C on its own; from here the commands do.
        _sigint_raises(True)
        _run(as_json)
    except KeyboardInterrupt:  # while an error was being said: still one line
        _interrupted(as_json)


def _interrupted(as_json: bool) -> None:
    _sigint_raises(False)  # a second Ctrl-C must not cut the one line short
    terminal.err.print("[yellow]interrupted[/yellow]")
    if as_json:
        terminal.print_json_error("interrupted", EXIT_INTERRUPTED, command=command_in(sys.argv[1:]))
    _leave_now(EXIT_INTERRUPTED)


def _leave_now(code: int) -> None:
    """Flush what was said and end the process with `code` at once. After a Ctrl-C
    Python's own teardown once ended the CLI by the signal (exit -2) although it had
    said "interrupted" and asked for 130 with SIGINT ignored: about 1 in 170 Ctrl-Cs
    landing as a command starts, under load (tests/test_interrupt.py). What unwinding
    had to undo (connections, the deploy's own report) is done by the time we are here."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: nothing more to say
            pass
    os._exit(code)


def _run(as_json: bool) -> None:
    debug = os.environ.get("DFLASHCTL_DEBUG") == "1"
    try:
        # Without standalone mode, click returns a `typer.Exit(code)` raised by a command.
        code = app(standalone_mode=False)
    except DflashError as exc:
        terminal.error(exc.message, exc.hint)
        if as_json:
            left = exc.nodes_json() if hasattr(exc, "nodes_json") else None
            terminal.print_json_error(
                exc.message, exc.exit_code, exc.hint, command_in(sys.argv[1:]), left
            )
        if debug:
            raise
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, CommandInterrupted):
        _interrupted(as_json)
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
