"""What a deploy says about what it sends: the size question, the left-out line, progress."""

# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
from __future__ import annotations

import io
import json
import subprocess
import sys

import yaml
from rich.console import Console

from dflashctl import terminal
from dflashctl.config import DEFAULT_EXCLUDE
from tests.test_deploy_support import project  # noqa: F401

DFLASHCTL = [sys.executable, "-m", "dflashctl"]


def cli_deploy(project, *extra: str) -> subprocess.CompletedProcess:
    # stdin is not a terminal here, as in CI or a script.
    return subprocess.run(
        [*DFLASHCTL, "deploy", "-c", str(project.config_path), "--detach", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def set_trainer(project, **keys) -> None:
    config = yaml.safe_load(project.config_path.read_text())
    config["trainer"].update(keys)
    project.config_path.write_text(yaml.safe_dump(config))


def test_more_than_confirm_above_mb_off_a_terminal_needs_yes_and_sends_nothing(project):
    (project.source / "assets").mkdir()
    (project.source / "assets" / "vocab.txt").write_text("token\n" * 2000)  # 12 KB
    set_trainer(project, confirm_above_mb=0.01)  # 10 kB
    refused = cli_deploy(project)
    assert refused.returncode == 2, refused.stderr
    assert "more than trainer.confirm_above_mb (0.01 MB)" in refused.stderr
    assert "assets/vocab.txt (11.7 KiB)" in refused.stderr
    assert "nothing was sent" in refused.stderr and "--yes" in refused.stderr
    assert "Traceback" not in refused.stderr
    releases = project.workdir / "releases"
    assert not releases.exists() or not list(releases.iterdir())
    assert not (project.workdir / "current").exists()

    sent = cli_deploy(project, "--yes", "--json")
    assert sent.returncode == 0, sent.stderr
    assert json.loads(sent.stdout)["files_sent"] == 4
    # A redeploy with nothing to send asks nothing.
    set_trainer(project, confirm_above_mb=0)
    again = cli_deploy(project, "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["bytes_sent"] == 0


def test_default_excludes_leave_out_weights_and_data_and_say_so_in_one_line(project):
    set_trainer(project, exclude=DEFAULT_EXCLUDE)
    (project.source / "model.safetensors").write_bytes(b"w" * 3000)
    (project.source / "optimizer.pt").write_bytes(b"o" * 10)
    for folder in ("data", "wandb", "runs"):
        (project.source / folder).mkdir()
        (project.source / folder / "x.jsonl").write_text("{}\n")
    result = cli_deploy(project, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)  # nothing but the summary on stdout
    assert summary["files_total"] == 3
    lines = [line for line in result.stderr.splitlines() if "left out" in line]
    assert lines == [
        "  left out by trainer.exclude: data/, runs/, wandb/, model.safetensors (2.9 KiB), "
        "optimizer.pt (10 B)"
    ]
    assert summary["left_out"] == [
        "data/",
        "runs/",
        "wandb/",
        "model.safetensors",
        "optimizer.pt",
    ]
    assert not (project.current() / "model.safetensors").exists()


def capture_stderr(monkeypatch) -> io.StringIO:
    buffer = io.StringIO()
    monkeypatch.setattr(terminal, "err", Console(file=buffer, width=200, highlight=False))
    return buffer


def test_plain_progress_lines_off_a_terminal(monkeypatch):
    buffer = capture_stderr(monkeypatch)
    now = [0.0]
    progress = terminal.PlainProgress(100 << 20, "sending 3 files", every=5.0, clock=lambda: now[0])
    for _ in range(10):  # 10 MiB per second
        now[0] += 1.0
        progress.sent(10 << 20)
    assert buffer.getvalue().splitlines() == [
        "  sending 3 files: 50.0 MiB of 100.0 MiB (50%), 10.0 MiB/s, 5s left",
        # the last piece ends the transfer: no line for it
    ]


def test_transfer_reports_nothing_with_json(monkeypatch):
    buffer = capture_stderr(monkeypatch)
    monkeypatch.setattr(terminal, "_json_mode", True)
    monkeypatch.setattr(terminal, "PLAIN_PROGRESS_EVERY_S", 0.0)
    with terminal.transfer(10, "sending", "unpacking") as sent:
        for _ in range(10):
            sent(1)
    assert buffer.getvalue() == ""
