"""A redeploy's upload, started as the CLI starts.

The one remote call of a redeploy (deploy.upload_and_deploy) is the same command every
time for the same config: the agent, whose program and archive come on its stdin
(agent_client.agent_argv). Its start-up on the host (the SSH session, `pct exec`, the
agent's interpreter and its imports) took about as long as the CLI's own start-up
(typer, rich, pydantic), one after the other. So the command lines of the last
successful deploy are remembered for the config file they were made from, and
dflashctl.entry starts them before it imports the CLI; the deploy takes one over
(transport/openssh.py) when it asks for exactly that command.

Anything else (another command, a changed config, a deploy that stops before its
upload) leaves them unused: their stdin is closed when this process ends, before any
program was written, and the agent ends having done nothing (agent_client.LOADER).

Standard library only, and light: dflashctl.entry imports it first thing.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from dflashctl.config.private_files import only_ours

_FORMAT = 1
_started: dict[tuple[str, ...], subprocess.Popen] = {}


def _record_path(config_path: Path) -> Path:
    name = hashlib.sha256(str(config_path.resolve()).encode()).hexdigest()[:32]
    # platformdirs' user_cache_path on Linux, without importing it this early.
    home = os.environ.get("XDG_CACHE_HOME", "").strip()
    cache = Path(home) if home else Path.home() / ".cache"
    return cache / "dflashctl" / "uploads" / f"{name}.json"


def _config_named(args: list[str]) -> Path:
    """The config file a command line names (config.find_config_path's order)."""
    path = os.environ.get("DFLASHCTL_CONFIG") or "dflash.yaml"
    for i, arg in enumerate(args):
        if arg in ("-c", "--config") and i + 1 < len(args):
            path = args[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
    found = Path(path).expanduser()
    return found / "dflash.yaml" if found.is_dir() else found


def _digest(config_path: Path) -> str:
    return hashlib.sha256(config_path.read_bytes()).hexdigest()


def start(args: list[str]) -> None:
    """Start the remembered uploads for `dflashctl <args>` when it is a deploy of the
    same config bytes; never fails (a deploy that finds none starts its own)."""
    mine = args[: args.index("--")] if "--" in args else args
    # `-c PATH` may come before the command too (cli.common_options_anywhere).
    values = {i + 1 for i, a in enumerate(mine) if a in ("-c", "--config")}
    words = [a for i, a in enumerate(mine) if not a.startswith("-") and i not in values]
    skip = {"--dry-run", "--start-container", "--help", "-h"}
    if not words or words[0] != "deploy" or skip & set(mine):
        return
    if os.environ.get("DFLASHCTL_SSH_CLIENT", "").lower() == "paramiko":
        return
    try:
        config_path = _config_named(mine)
        record = _record_path(config_path)
        if not only_ours(record):
            return
        saved = json.loads(record.read_text(encoding="utf-8"))
        if saved.get("format") != _FORMAT or saved.get("config_sha256") != _digest(config_path):
            return
        for command in saved["commands"]:
            if isinstance(command, list) and command and all(isinstance(a, str) for a in command):
                _started[tuple(command)] = subprocess.Popen(
                    command,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    bufsize=0,
                )
    except (OSError, ValueError, KeyError, TypeError):
        return


def take(command: list[str]) -> subprocess.Popen | None:
    """The process started for exactly `command`, still waiting for its stdin, or None."""
    process = _started.pop(tuple(command), None)
    if process is not None and process.poll() is not None:
        return None  # it ended already (the connection or the container went away)
    return process


def remember(config_path: Path, commands: list[list[str]] | None) -> None:
    """After a deploy from `config_path`: its uploads' command lines, for the next one
    to start early (None: some node has none to give, so forget them). Never fails."""
    try:
        record = _record_path(config_path)
        if commands is None:
            record.unlink(missing_ok=True)
            return
        record.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        text = json.dumps(
            {"format": _FORMAT, "config_sha256": _digest(config_path), "commands": commands}
        )
        temporary = record.with_name(f".{record.name}.{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, record)
    except OSError:
        return
