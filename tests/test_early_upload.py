# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""A redeploy's upload started as the CLI starts (dflashctl/ops/early_upload.py): only for a
deploy of the same config bytes, only from a record that is ours alone, and one that
is not used ends having done nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashctl.ops import early_upload
from tests.test_deploy_support import write_trainer

DFLASHCTL = [sys.executable, "-m", "dflashctl"]
CLI_TIMEOUT_S = 300  # a bound on a hung command, not a speed check


@pytest.fixture
def record(tmp_path, monkeypatch):
    """(config path, a marker file): a remembered upload that writes the marker when
    it starts and then waits for its stdin, as the agent does."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("DFLASHCTL_SSH_CLIENT", raising=False)
    config = tmp_path / "dflash.yaml"
    config.write_text("host: {address: local}\n")
    marker = tmp_path / "started"
    command = ["sh", "-c", f'echo up > "{marker}"; cat >/dev/null', "agent"]
    early_upload.remember(config, [command])
    yield config, marker, command
    for process in early_upload._started.values():
        process.kill()
        process.wait()
    early_upload._started.clear()


def _started(marker: Path) -> bool:
    _wait(marker.exists, "the remembered command to start")
    return True


def test_a_deploy_of_the_same_config_starts_the_remembered_upload(record):
    config, marker, command = record
    early_upload.start(["deploy", "-c", str(config), "--detach"])
    process = early_upload.take(command)
    assert process is not None and _started(marker)
    assert early_upload.take(command) is None  # taken once
    process.stdin.close()  # nothing written: it ends
    assert process.wait(timeout=30) == 0


@pytest.mark.parametrize(
    "args",
    [
        ["status", "-c", "{config}"],
        ["deploy", "-c", "{config}", "--dry-run"],
        ["deploy", "-c", "{config}", "--start-container"],
        ["deploy", "--help"],
        ["deploy", "-c", "{other}"],
    ],
)
def test_nothing_starts_for_another_command_or_another_config(record, tmp_path, args):
    config, marker, command = record
    (tmp_path / "other.yaml").write_text(config.read_text())
    early_upload.start([a.format(config=config, other=tmp_path / "other.yaml") for a in args])
    assert early_upload.take(command) is None and not early_upload._started


def test_a_changed_config_starts_nothing(record):
    config, marker, command = record
    config.write_text(config.read_text() + "# edited\n")
    early_upload.start(["deploy", "--config", str(config)])
    assert not early_upload._started


def test_a_record_others_could_write_is_not_run(record, tmp_path):
    config, marker, command = record
    (entry,) = (tmp_path / "cache" / "dflashctl" / "uploads").iterdir()
    entry.chmod(0o666)
    early_upload.start(["deploy", "-c", str(config)])
    assert not early_upload._started
    entry.chmod(0o600)
    entry.write_text("not json")
    early_upload.start(["deploy", "-c", str(config)])
    assert not early_upload._started


def test_the_config_is_found_as_the_cli_finds_it(record, tmp_path, monkeypatch):
    config, marker, command = record
    monkeypatch.chdir(tmp_path)
    early_upload.start(["deploy", "--detach"])  # ./dflash.yaml
    assert early_upload.take(command) is not None


def test_forgotten_when_a_node_has_no_command_line(record):
    config, marker, command = record
    early_upload.remember(config, None)
    early_upload.start(["deploy", "-c", str(config)])
    assert not early_upload._started


# ----------------------------------------------------------------- on the test host


@pytest.fixture
def setup(tmp_path, container, write_config, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("DFLASHCTL_SSH_CLIENT", raising=False)
    source = write_trainer(tmp_path / "src")
    path = write_config(
        tmp_path,
        trainer_source=source,
        **{"trainer.entry": "train.py", "trainer.args": ["--sleep", "60"], "run.stop_grace_s": 3},
    )
    return path, source, container


def _deploy(path: Path) -> dict:
    done = subprocess.run(
        [*DFLASHCTL, "deploy", "-c", str(path), "--detach", "--yes", "--json"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _agents(container) -> list[str]:
    """The agent processes in the container (their command lines)."""
    ps = container.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '; true"])
    return [line for line in ps.stdout.split("dflash_agent")[1:]] if ps.stdout else []


def test_a_redeploy_runs_through_its_early_upload_and_an_unused_one_does_nothing(setup):
    path, source, container = setup
    first = _deploy(path)
    records = list((path.parent / "cache" / "dflashctl" / "uploads").iterdir())
    assert len(records) == 1 and os.stat(records[0]).st_mode & 0o077 == 0
    (source / "helpers.py").write_text("def greeting():\n    return 'early'\n")
    second = _deploy(path)
    node = second["nodes"][0]
    assert node["files_sent"] == 1 and second["release"] != first["release"]
    shown = container.exec(["cat", f"/root/dflash/releases/{second['release']}/helpers.py"])
    assert "early" in shown.stdout
    # The remembered command is the real upload: started here, an agent waits in the
    # container for its program; its stdin closed, it ends having changed nothing.
    before = container.exec(["sh", "-c", "ls -R /root/dflash | sort"]).stdout
    early_upload.start(["deploy", "-c", str(path)])
    (process,) = early_upload._started.values()
    _wait(lambda: len(_agents(container)) == 1, "the early agent in the container")
    early_upload._started.clear()
    process.stdin.close()
    assert process.wait(timeout=CLI_TIMEOUT_S) == 0
    _wait(lambda: not _agents(container), "the unused agent to end")
    assert container.exec(["sh", "-c", "ls -R /root/dflash | sort"]).stdout == before
    # Nothing changed: the upload started early is not needed, and ends unused.
    third = _deploy(path)
    assert third["release"] == second["release"] and third["nodes"][0]["files_sent"] == 0
    _wait(lambda: not _agents(container), "the unused agent to end")


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + CLI_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"waited for {what}"
        time.sleep(0.05)
