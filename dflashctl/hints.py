"""Commands we suggest to the user, spelled so they can be pasted as they are.

A user who ran `dflashctl deploy -c templates/demo.yaml` needs `-c templates/demo.yaml`
on the `dflashctl logs -f <run>` we suggest too, or it fails with "no such config
file". load_config() remembers an explicit --config here.
"""

from __future__ import annotations

import os
import shlex

_config_flag = ""


def remember_config(explicit: str | os.PathLike | None) -> None:
    global _config_flag
    _config_flag = f" -c {shlex.quote(os.fspath(explicit))}" if explicit else ""


def command(args: str) -> str:
    """`dflashctl <args>` plus the --config the user gave, in backticks."""
    return f"`dflashctl {args}{_config_flag}`"
