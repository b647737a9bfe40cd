"""`--help` that reads well: no type labels beside flags, whole sentences, an example
in every command's help, the environment variables, shell completion, -q and -v."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [
    "init",
    "doctor",
    "status",
    "deploy",
    "restart",
    "stop",
    "logs",
    "exec",
    "shell",
    "pull",
    "stacks",
    "runs",
    "runs show",
    "container",
    "container create",
]
TYPE_LABEL = re.compile(r"<(bool|str|int|float|path|list\[[^\]]*\])[^>]*>|\[x>=")


def dflashctl(*args: str, columns: int = 80, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH")}
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=dict(env, COLUMNS=str(columns), TERM="dumb"),
    )


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_has_no_type_labels_and_an_example(command):
    proc = dflashctl(*command.split(), "--help")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert not TYPE_LABEL.search(text), text
    examples = text.split("Examples:\n", 1)[1].splitlines()
    assert examples[0].strip().startswith(f"dflashctl {command}".strip()), text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "[[" not in text.splitlines()[0]  # usage: `[RUN [RUN2]]`, not `[[RUN] [RUN2]]...`
    if "Arguments:\n" in text:  # each argument says what it is, whatever typer's version
        for line in text.split("Arguments:\n", 1)[1].split("\n\n", 1)[0].splitlines():
            if not line.startswith("     "):
                assert len(line.strip().split("  ")) > 1, line


def test_the_command_list_says_each_command_in_one_whole_sentence():
    text = dflashctl("--help").stdout
    listing = text.split("Commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in listing] == [c for c in COMMANDS if " " not in c]
    for line in listing:
        assert line.endswith(".") and "..." not in line, line


def test_the_root_help_names_every_environment_variable():
    text = dflashctl("--help", columns=120).stdout
    environment = text.split("Environment:\n", 1)[1]
    for name in ("DFLASHCTL_CONFIG", "DFLASHCTL_DEBUG", "DFLASHCTL_SSH_CONFIG", "NO_COLOR"):
        assert name in environment
    # Every DFLASHCTL_* variable the code reads is in it.
    read = set()
    for path in (ROOT / "dflashctl").rglob("*.py"):
        read |= set(re.findall(r"\bDFLASHCTL_[A-Z_]+", path.read_text()))
    assert read and all(name in environment for name in read), read


def test_shell_completion_is_on():
    # Typer names the shell it finds among the command's parents: run it from bash, as a
    # bash user would (under `make`, the nearest shell is sh, which it does not support).
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH")}
    proc = subprocess.run(
        ["bash", "-c", '"$0" -m dflashctl --show-completion; exit $?', sys.executable],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(env, TERM="dumb"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "_dflashctl_completion" in proc.stdout or "complete" in proc.stdout
    assert "--install-completion" in dflashctl("--help").stdout


def local_config(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text("print('hi')\n")
    path = tmp_path / "dflash.yaml"
    path.write_text(
        "host: {address: local}\n"
        f"container: {{vmid: null, workdir: {tmp_path / 'w'}, python: {sys.executable}}}\n"
        f"trainer: {{source: {source}, entry: train.py}}\n"
    )
    return path


def test_verbose_shows_the_commands_run_and_quiet_hides_the_step_lines(tmp_path):
    config = str(local_config(tmp_path))
    plain = dflashctl("deploy", "--dry-run", "-c", config)
    assert plain.returncode == 0, plain.stderr
    assert "✓ checked" in plain.stderr and "$ (" not in plain.stderr

    verbose = dflashctl("-v", "deploy", "--dry-run", "-c", config)
    assert verbose.returncode == 0, verbose.stderr
    ran = [line for line in verbose.stderr.splitlines() if line.startswith("$ (this machine) ")]
    assert ran and sys.executable in ran[0], verbose.stderr
    assert all(len(line) < 400 for line in ran)  # the agent's program is not printed whole

    quiet = dflashctl("-q", "deploy", "--dry-run", "-c", config)
    assert quiet.returncode == 0, quiet.stderr
    assert "✓" not in quiet.stderr
    assert quiet.stdout.splitlines()[0] == plain.stdout.splitlines()[0]  # the results stay
    assert "nothing to stop" in quiet.stdout


def test_a_dropped_stream_is_said_in_a_few_words_not_with_the_agents_command():
    from dflashctl.follow.follower import drop_reason
    from dflashctl.remote.transport.base import CommandTimeout, ConnectionLost

    program = "import sys\n" + "x = 1\n" * 500
    lost = ConnectionLost("root@pve:22", f"streaming `python3 -S -c {program!r}`")
    assert drop_reason(lost) == "the SSH connection to root@pve:22 dropped"
    slow = CommandTimeout(["python3", "-S", "-c", program], "root@pve:22", 30)
    assert len(drop_reason(slow)) <= 100 and "\n" not in drop_reason(slow)
