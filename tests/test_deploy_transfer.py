"""What a deploy sends and says about it: the size question, the left-out line, progress;
files of any name; the run's bytecode kept out of its release."""

# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import yaml
from rich.console import Console

from dflashctl.config.schema import DEFAULT_EXCLUDE
from dflashctl.ui import terminal
from tests.json_answers import flat
from tests.test_deploy_support import project, release_manifest, wait_for  # noqa: F401

DFLASHCTL = [sys.executable, "-m", "dflashctl"]


def cli_deploy(project, *extra: str) -> subprocess.CompletedProcess:
    # stdin is not a terminal here, as in CI or a script.
    return subprocess.run(
        [*DFLASHCTL, "deploy", "-c", str(project.config_path), "--detach", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        # As on a usual machine: Python writes bytecode (this one's CI may say not to).
        env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
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
    assert flat(json.loads(sent.stdout))["files_sent"] == 4
    # A redeploy with nothing to send asks nothing.
    set_trainer(project, confirm_above_mb=0)
    again = cli_deploy(project, "--json")
    assert again.returncode == 0, again.stderr
    assert flat(json.loads(again.stdout))["bytes_sent"] == 0


def test_default_excludes_leave_out_weights_and_data_and_say_so_in_one_line(project):
    set_trainer(project, exclude=DEFAULT_EXCLUDE)
    (project.source / "model.safetensors").write_bytes(b"w" * 3000)
    (project.source / "optimizer.pt").write_bytes(b"o" * 10)
    for folder in ("data", "wandb", "runs"):
        (project.source / folder).mkdir()
        (project.source / folder / "x.jsonl").write_text("{}\n")
    result = cli_deploy(project, "--json")
    assert result.returncode == 0, result.stderr
    summary = flat(json.loads(result.stdout))  # nothing but the summary on stdout
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


def test_any_file_name_deploys_manifest_json_included(project):
    user_manifest = '{"vocab": "tok.json", "shards": 4}'
    (project.source / "MANIFEST.json").write_text(user_manifest)
    (project.source / ".dflashctl").mkdir()
    (project.source / ".dflashctl" / "manifest.json").write_text("{}")
    (project.source / "with space ü.txt").write_text("odd\n")
    first = cli_deploy(project, "--json")
    assert first.returncode == 0, first.stderr
    release = project.current()
    assert (release / "MANIFEST.json").read_text() == user_manifest
    assert (release / ".dflashctl" / "manifest.json").read_text() == "{}"
    assert (release / "with space ü.txt").read_text() == "odd\n"
    assert "MANIFEST.json" in release_manifest(release)

    (project.source / "MANIFEST.json").write_text('{"shards": 8}')
    again = cli_deploy(project, "--json")
    assert again.returncode == 0, again.stderr
    assert flat(json.loads(again.stdout))["files_sent"] == 1
    assert (project.current() / "MANIFEST.json").read_text() == '{"shards": 8}'


def test_the_run_writes_its_bytecode_outside_its_release(project):
    first = cli_deploy(project, "--json")
    assert first.returncode == 0, first.stderr
    run_dir = project.run_dir(flat(json.loads(first.stdout))["run_id"])
    # The fake trainer imports helpers.py: its bytecode goes to the workdir's shared
    # cache, at the release's own path (removed with the release), not the run's folder.
    cache = run_dir.parent.parent / "pycache"
    release = project.current().resolve()
    wait_for(lambda: list(cache.rglob("helpers*.pyc")), what="helpers' bytecode")
    (pyc,) = cache.rglob("helpers*.pyc")
    assert str(pyc).startswith(str(cache) + str(release))
    assert not (run_dir / "pycache").exists()
    assert not list(project.current().rglob("__pycache__"))


def test_bytecode_written_into_a_release_breaks_no_later_deploy(project):
    # A trainer.env that asks for the old behaviour: bytecode next to the sources.
    set_trainer(project, env={"PYTHONPYCACHEPREFIX": ""})
    first = cli_deploy(project, "--json")
    assert first.returncode == 0, first.stderr
    old_release = project.current()
    wait_for(lambda: list(old_release.glob("__pycache__/helpers*.pyc")), what="bytecode")

    (project.source / "train.py").write_text(
        (project.source / "train.py").read_text() + "# edited\n"
    )
    again = cli_deploy(project, "--json")
    assert again.returncode == 0, again.stderr
    summary = flat(json.loads(again.stdout))
    # One round trip (the remembered manifest still matches), one file sent, and the
    # previous release keeps what its run wrote.
    assert "inspected" not in again.stderr
    assert summary["files_sent"] == 1 and summary["previous_release"] == old_release.name
    assert list(old_release.glob("__pycache__/helpers*.pyc"))
    assert not (project.current() / "__pycache__" / "junk.pyc").exists()
