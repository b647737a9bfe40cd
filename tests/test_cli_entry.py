"""The entry point and the help's own words: the version, the JSON answer of a Ctrl-C
before any command ran (written by hand in dflashctl/entry.py) matching the one the
commands give, and every example of the help parsing against the real command line."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
import typer

from dflashctl import __version__
from dflashctl.cli import app, main
from dflashctl.entry import EXIT_INTERRUPTED
from dflashctl.errors import EXIT_INTERRUPTED as COMMANDS_EXIT_INTERRUPTED
from dflashctl.ui.help import EXAMPLES, SHORT_HELP
from dflashctl.ui.json_output import error_document


def test_version_prints_the_packages_version(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dflashctl", "--version"])
    main()  # returns: exit status 0
    assert capsys.readouterr().out == f"dflashctl {__version__}\n"


@pytest.mark.parametrize(
    ("argv", "command"),
    [(["runs", "show", "R", "--json"], "runs show"), (["-q", "stop", "--json"], "stop")],
)
def test_an_interrupt_while_starting_answers_as_the_commands_do(argv, command):
    early = subprocess.run(
        [
            sys.executable,
            "-c",
            "from dflashctl.entry import _interrupted_while_starting\n"
            "_interrupted_while_starting(2, None)",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert early.returncode == EXIT_INTERRUPTED == COMMANDS_EXIT_INTERRUPTED
    assert early.stderr == "interrupted\n"
    assert json.loads(early.stdout) == error_document(
        "interrupted", COMMANDS_EXIT_INTERRUPTED, None, command
    )


def commands(group=None, prefix=""):
    group = group or typer.main.get_command(app)
    for name, command in group.commands.items():
        yield prefix + name, command
        if hasattr(command, "commands"):
            yield from commands(command, f"{prefix}{name} ")


def test_every_command_has_its_short_help_and_examples():
    names = {name for name, _ in commands()}
    assert names == set(SHORT_HELP) == set(EXAMPLES)


@pytest.mark.parametrize("example", sorted({e for examples in EXAMPLES.values() for e in examples}))
def test_every_example_in_the_help_parses_on_the_real_command_line(example):
    words = shlex.split(example)[1:]
    command = typer.main.get_command(app)
    while words and hasattr(command, "commands") and words[0] in command.commands:
        command = command.commands[words.pop(0)]
    # An option the command does not have, or a value of the wrong type, raises here.
    command.make_context(example, words)
