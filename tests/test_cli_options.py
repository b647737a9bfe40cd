"""The common options on either side of the command, short options that mean one thing,
help that reads right, and shell completion of run ids."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dflashctl.cli import common_options_anywhere
from tests.test_help import dflashctl, local_config


def test_config_before_the_command_and_verbose_after_it_are_taken(tmp_path):
    config = str(local_config(tmp_path))
    before = dflashctl("-c", config, "deploy", "--dry-run")
    assert before.returncode == 0, before.stderr
    assert "nothing to stop" in before.stdout

    verbose = dflashctl("deploy", "--dry-run", "-v", "-c", config)
    assert verbose.returncode == 0, verbose.stderr
    assert any(line.startswith("$ (this machine) ") for line in verbose.stderr.splitlines())

    quiet = dflashctl("--config", config, "deploy", "--dry-run", "--quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert "✓" not in quiet.stderr

    missing = dflashctl("-c", str(tmp_path / "nope.yaml"), "pull", "20260101-120000-ab12")
    assert missing.returncode == 2
    assert "nope.yaml: no such config file" in missing.stderr, missing.stderr


def test_what_follows_the_double_dash_or_execs_command_is_left_alone():
    assert common_options_anywhere(["deploy", "--", "-v", "-c", "x"]) == [
        "deploy",
        "--",
        "-v",
        "-c",
        "x",
    ]
    assert common_options_anywhere(["exec", "ls", "-v"]) == ["exec", "ls", "-v"]
    assert common_options_anywhere(["-c", "a.yaml", "runs", "show", "-q", "R"]) == [
        "-q",
        "runs",
        "show",
        "-c",
        "a.yaml",
        "R",
    ]
    # an option's value that looks like a flag stays the option's
    assert common_options_anywhere(["pull", "R", "--to", "-v"]) == ["pull", "R", "--to", "-v"]
    assert common_options_anywhere(["exec", "-n", "gpu-b", "--", "ls"]) == [
        "exec",
        "-N",
        "gpu-b",
        "--",
        "ls",
    ]


def test_short_options_mean_one_thing_and_the_help_reads_right():
    logs = dflashctl("logs", "--help").stdout
    assert "-n, --lines" in logs
    for command in ("exec", "shell"):
        text = dflashctl(command, "--help").stdout
        assert "-N, --node" in text and "-n, --node" not in text
    exec_help = dflashctl("exec", "--help").stdout
    assert exec_help.count("(") == exec_help.count(")"), exec_help
    assert "--to DIR" in dflashctl("pull", "--help").stdout


def complete(config: Path, line: str) -> list[str]:
    """What bash completion offers for `line` (the word being completed last)."""
    words = line.split(" ")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH")}
    env.update(
        _DFLASHCTL_COMPLETE="complete_bash",
        COMP_WORDS=line,
        COMP_CWORD=str(len(words) - 1),
        DFLASHCTL_CONFIG=str(config),
        PYTHONPATH=str(Path(__file__).resolve().parents[1]),  # this checkout's dflashctl
    )
    done = subprocess.run(
        [str(Path(sys.executable).parent / "dflashctl")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_run_ids_complete_for_logs_pull_and_runs_show(tmp_path):
    config = local_config(tmp_path)
    (tmp_path / "src" / "train.py").write_text("print('hi')\n")
    ids = []
    for _ in range(2):
        done = dflashctl("deploy", "--detach", "-c", str(config))
        assert done.returncode == 0, done.stderr
        ids.append(done.stderr.split("launched run ", 1)[1].split()[0])
    for line in ("dflashctl logs ", "dflashctl pull ", "dflashctl runs show "):
        assert set(complete(config, line)) == set(ids), line
    assert complete(config, f"dflashctl logs {ids[1][:-2]}") == [ids[1]]
