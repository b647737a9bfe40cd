# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""deploy, restart, stop and runs against the test host: a real sshd on loopback whose
`pct` drives bubblewrap containers (own pid namespace, own /root and /tmp)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflashctl.commands.deploy import show_plan
from dflashctl.config.schema import load_config
from dflashctl.errors import HostError
from dflashctl.ops.deploy import DeployOptions, deploy
from dflashctl.remote.connect import open_target
from dflashctl.remote.nodes import NodesFailed
from dflashctl.runs.records import RunState, run_state
from tests.json_answers import flat, one_node
from tests.test_deploy_support import snapshot, write_trainer
from tests.test_stop import stop

pytestmark = pytest.mark.slow

WORKDIR = "/root/dflash"
DFLASHCTL = [sys.executable, "-m", "dflashctl"]
# A bound on a hung command, not a speed check: a CLI call took over 60 s on a machine
# shared with other work.
CLI_TIMEOUT_S = 300


@pytest.fixture
def setup(tmp_path, container, write_config, monkeypatch):
    """(config path, trainer source, container) with a fake trainer that waits for SIGTERM."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = write_trainer(tmp_path / "src")
    path = write_config(
        tmp_path,
        trainer_source=source,
        **{
            "trainer.entry": "train.py",
            "trainer.args": ["--sleep", "60", "--on-term", "checkpoint"],
            "run.stop_grace_s": 3,
            "run.keep_releases": 2,
        },
    )
    return path, source, container


def detached(path: Path, **options) -> dict:
    code, summary = deploy(load_config(path), DeployOptions(detach=True, **options))
    assert code == 0
    return one_node(summary)


def ct_pid_alive(container, pid: int) -> bool:
    """Is `pid` (a pid inside the container) alive and not a zombie?"""
    result = container.exec(["sh", "-c", f"cat /proc/{pid}/stat 2>/dev/null"])
    stat = result.stdout
    return bool(stat) and stat[stat.rindex(")") + 2] not in "ZX"


def ct_spawn(container, command: str) -> int:
    """Start `command` detached in the container; returns its pid there."""
    # The pid comes back on fd 3, which the command closes: exec then returns at once.
    script = f"setsid sh -c 'echo $$ >&3; exec {command} 3>&-' 3>&1 >/dev/null 2>&1 </dev/null &"
    result = container.exec(["sh", "-c", script], timeout=60)
    return int(result.stdout.split()[0])


def wait_started(container, summary: dict) -> None:
    """Until the run printed its first line (its SIGTERM handler is set by then)."""
    log = container.host_path(f"{WORKDIR}/runs/{summary['run_id']}/train.log")
    # A generous net: interpreter start-up on a loaded machine; it returns once the line is there.
    deadline = time.monotonic() + 120
    while "hello" not in log.read_text():
        assert time.monotonic() < deadline, "the trainer did not start"
        time.sleep(0.05)


def state(path: Path, run_id: str) -> RunState:
    config = load_config(path)
    target = open_target(config)
    try:
        return run_state(target, WORKDIR, run_id, python=config.container.python)
    finally:
        target.transport.close()


def wait_state(path: Path, run_id: str, timeout: float = 120) -> RunState:
    deadline = time.monotonic() + timeout
    while True:
        current = state(path, run_id)
        if current.finished or time.monotonic() > deadline:
            return current
        time.sleep(0.2)


def test_deploy_lands_files_in_the_container_and_launches(setup):
    path, source, container = setup
    summary = detached(path)
    workdir = container.host_path(WORKDIR)
    assert os.readlink(workdir / "current") == f"releases/{summary['release']}"
    release = workdir / "releases" / summary["release"]
    for rel in ("train.py", "helpers.py", "configs/tiny.yaml"):
        assert (release / rel).read_bytes() == (source / rel).read_bytes()
    assert summary["files_sent"] == 3 and summary["target"].startswith("CT 200")
    # The run lives in the container's pid namespace, in its own session.
    assert ct_pid_alive(container, summary["pid"])
    stat = container.exec(["cat", f"/proc/{summary['pid']}/stat"]).stdout
    pgid = stat[stat.rindex(")") + 2 :].split()[2]
    assert pgid == str(summary["pid"])
    meta = json.loads((workdir / "runs" / summary["run_id"] / "meta.json").read_text())
    assert meta["release"] == summary["release"] and meta["pid"] == summary["pid"]
    # Nothing is left in the host's or the container's /tmp.
    assert not list(container.tmp.glob("*dflashctl-upload-*"))


def test_second_deploy_stops_first_and_hand_started_runs_only(setup):
    path, source, container = setup
    first = detached(path)
    wait_started(container, first)
    # By hand, as in the old loop: a copy of the trainer run from under the workdir...
    container.exec(["cp", "-r", f"{WORKDIR}/current/.", f"{WORKDIR}/by-hand"])
    stale = ct_spawn(container, f"{sys.executable} {WORKDIR}/by-hand/train.py --sleep 60")
    # ...and another experiment's copy of the same script elsewhere: not ours to stop.
    container.exec(["cp", "-r", f"{WORKDIR}/current/.", "/root/other-experiment"])
    elsewhere = ct_spawn(container, f"{sys.executable} /root/other-experiment/train.py --sleep 60")
    (container.root / "other.py").write_text("import time\ntime.sleep(60)\n")
    sleeper = ct_spawn(container, "sleep 60")
    other = ct_spawn(container, f"{sys.executable} /root/other.py")
    (source / "helpers.py").write_text("def greeting():\n    return 'second'\n")

    second = detached(path)
    stopped = {s["pid"]: s for s in second["runs_stopped"]}
    assert set(stopped) == {first["pid"], stale}
    assert stopped[first["pid"]]["run_id"] == first["run_id"]
    assert stopped[first["pid"]]["ended"] == "terminated"
    assert stopped[stale]["run_id"] is None
    assert not ct_pid_alive(container, first["pid"]) and not ct_pid_alive(container, stale)
    assert ct_pid_alive(container, sleeper) and ct_pid_alive(container, other)
    assert ct_pid_alive(container, elsewhere)
    container.exec(["kill", str(elsewhere)])
    assert ct_pid_alive(container, second["pid"])
    run_dir = container.host_path(f"{WORKDIR}/runs/{first['run_id']}")
    assert (run_dir / "checkpointed").exists()  # it had its grace period
    assert second["files_sent"] == 1


def test_no_change_redeploy_sends_no_file_content(setup):
    path, _, container = setup
    first = detached(path)
    second = detached(path)
    assert (second["files_sent"], second["bytes_sent"], second["archive_bytes"]) == (0, 0, 0)
    assert second["release"] == first["release"]


def test_dry_run_changes_nothing_in_the_container(setup, capsys):
    path, source, container = setup
    first = detached(path)
    wait_started(container, first)
    (source / "helpers.py").write_text("def greeting():\n    return 'planned'\n")
    before = snapshot(container.root), snapshot(container.tmp)
    capsys.readouterr()
    code, summary = deploy(load_config(path), DeployOptions(dry_run=True))
    show_plan(summary)
    plan = one_node(summary)
    out = capsys.readouterr().out
    assert code == 0
    assert (snapshot(container.root), snapshot(container.tmp)) == before
    assert ct_pid_alive(container, first["pid"])
    assert "+ helpers.py" in out and f"pid {first['pid']} (run {first['run_id']}" in out
    assert [r["pid"] for r in plan["runs_to_stop"]] == [first["pid"]]


def test_syntax_error_refuses_before_contacting_the_host(setup, pve_host):
    path, source, _ = setup
    (source / "broken.py").write_text("def f(:\n")
    config_text = path.read_text().replace(f"port: {pve_host.port}", "port: 9")  # nothing there
    path.write_text(config_text)
    result = subprocess.run(
        [*DFLASHCTL, "deploy", "-c", str(path), "--detach"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 2, result.stderr
    assert "broken.py:1:" in result.stderr and "^" in result.stderr


def test_stopped_container_is_an_error_unless_asked_to_start_it(
    tmp_path, make_container, write_config, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    container = make_container(201, running=False)
    source = write_trainer(tmp_path / "src")
    path = write_config(
        tmp_path,
        vmid=201,
        trainer_source=source,
        **{"trainer.entry": "train.py", "trainer.args": ["--exit", "0"]},
    )
    result = subprocess.run(
        [*DFLASHCTL, "deploy", "-c", str(path), "--detach"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 3
    assert "container 201 is not running" in result.stderr
    assert "--start-container" in result.stderr
    assert not container.is_running()

    # A dry run changes nothing: it does not start the container either.
    result = subprocess.run(
        [*DFLASHCTL, "deploy", "-c", str(path), "--dry-run", "--start-container"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 3 and not container.is_running()

    result = subprocess.run(
        [*DFLASHCTL, "deploy", "-c", str(path), "--detach", "--start-container", "--json"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert "started container 201" in result.stderr
    assert container.is_running()
    first = flat(json.loads(result.stdout))
    assert first["files_sent"] == 3

    # Stopped again: a redeploy (which would skip asking the container) starts it too.
    container.stop()
    again = detached(path, start_container=True)
    assert container.is_running()
    assert again["files_sent"] == 0 and again["release"] == first["release"]


def drop_once_partial(container, dropping, size: int = 4 << 20) -> list[Path]:
    """Start a thread that calls dropping() once the release being built
    (releases/<id>.partial: the archive is unpacked as it arrives) holds `size` bytes
    of weights.bin; returns the list that then names that file."""
    releases = container.host_path(WORKDIR) / "releases"
    seen: list[Path] = []

    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for partial in releases.glob("*.partial"):
                try:
                    if (partial / "weights.bin").stat().st_size > size:
                        dropping()
                        seen.append(partial / "weights.bin")
                        return
                except FileNotFoundError:
                    continue
            time.sleep(0.002)

    threading.Thread(target=watch, name="dropper", daemon=True).start()
    return seen


def test_upload_cut_by_a_dropped_connection_leaves_the_previous_release_running(setup, pve_host):
    path, source, container = setup
    first = detached(path)
    # A file big enough that the upload is still going when the connection drops.
    (source / "weights.bin").write_bytes(os.urandom(48 << 20))
    dropped = drop_once_partial(container, pve_host.drop_connections)
    with pytest.raises(NodesFailed) as info:
        detached(path)
    assert isinstance(info.value.cause, HostError)  # one node: its own error's words and hint
    assert "dropped" in info.value.message and "dflashctl runs" in info.value.hint
    assert dropped
    workdir = container.host_path(WORKDIR)
    assert os.readlink(workdir / "current") == f"releases/{first['release']}"
    assert ct_pid_alive(container, first["pid"])
    assert state(path, first["run_id"]).status == "running"
    # The agent saw its archive end early and removed what it had unpacked.
    deadline = time.monotonic() + 60  # a net: the loop ends as soon as the folder is gone
    while list((workdir / "releases").glob("*.partial")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list((workdir / "releases").glob("*.partial"))
    assert sorted(p.name for p in (workdir / "releases").iterdir() if p.is_dir()) == [
        first["release"]
    ]

    (source / "weights.bin").unlink()
    (source / "helpers.py").write_text("def greeting():\n    return 'after the drop'\n")
    second = detached(path)
    assert not list((workdir / "releases").glob("*.partial"))
    assert not ct_pid_alive(container, first["pid"])
    assert os.readlink(workdir / "current") == f"releases/{second['release']}"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--steps", "2"], RunState("exited", 0, None)),
        (["--exit", "3"], RunState("exited", 3, None)),
        (["--kill", "SIGTERM"], RunState("killed", 143, 15)),
    ],
)
def test_exit_code_file_in_the_container(setup, write_config, args, expected):
    path, source, container = setup
    write_config(path, trainer_source=source, **{"trainer.entry": "train.py", "trainer.args": args})
    summary = detached(path)
    assert wait_state(path, summary["run_id"]) == expected
    exit_code = container.host_path(f"{WORKDIR}/runs/{summary['run_id']}/exit_code")
    assert exit_code.read_text() == f"{expected.exit_code}\n"


def test_cli_stop_restart_and_runs_in_the_container(setup):
    path, _, container = setup
    first = detached(path)
    wait_started(container, first)
    run = [*DFLASHCTL]
    restarted = subprocess.run(
        [*run, "restart", "-c", str(path), "--detach", "--json"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert restarted.returncode == 0, restarted.stderr
    second = flat(json.loads(restarted.stdout))
    wait_started(container, second)
    assert second["release"] == first["release"]
    assert [s["pid"] for s in second["runs_stopped"]] == [first["pid"]]

    stopped = subprocess.run(
        [*run, "stop", "-c", str(path), "--grace", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert stopped.returncode == 0, stopped.stderr
    [item] = flat(json.loads(stopped.stdout))["stopped"]
    assert item["run_id"] == second["run_id"]

    listed = subprocess.run(
        [*run, "runs", "-c", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    runs = {r["id"]: r for r in flat(json.loads(listed.stdout))["runs"]}
    # Both checkpointed on SIGTERM and exited 0, and both read as stopped: by whom,
    # when, for which run (a stopped run is never "finished").
    first_state, second_state = runs[first["run_id"]], runs[second["run_id"]]
    assert (first_state["status"], first_state["exit_code"]) == ("stopped", 0)
    assert first_state["stopped"]["by"] == "restart"
    assert first_state["stopped"]["replaced_by"] == second["run_id"]
    assert first_state["state"].startswith("stopped by restart at ")
    assert (second_state["status"], second_state["outcome"]) == ("stopped", "stopped")
    assert second_state["stopped"]["by"] == "stop"
    assert not ct_pid_alive(container, second["pid"])


def test_runs_prune_removes_ended_runs_and_never_the_running_one(setup):
    path, _, container = setup
    launched = [detached(path) for _ in range(3)]  # each deploy stops the run before it
    wait_started(container, launched[-1])
    first, second, third = (s["run_id"] for s in launched)
    runs_dir = container.host_path(f"{WORKDIR}/runs")
    big = runs_dir / first / "outputs" / "ckpt.bin"
    big.parent.mkdir()
    big.write_bytes(b"\0" * 300_000)

    def prune(*args):
        return subprocess.run(
            [*DFLASHCTL, "runs", "-c", str(path), "--prune", *args],
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
        )

    # Off a terminal, nothing goes without --yes; --dry-run only lists.
    refused = prune("0")
    assert refused.returncode == 2 and "nothing was removed" in refused.stderr
    assert "--yes" in refused.stderr
    dry = prune("0", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = flat(json.loads(dry.stdout))
    assert plan["dry_run"] and [r["id"] for r in plan["removed"]] == [first, second]
    assert plan["spared"] == [third] and plan["bytes"] > 300_000
    assert sorted(p.name for p in runs_dir.iterdir()) == sorted([first, second, third])

    kept_two = prune("2", "--yes", "--json")
    assert kept_two.returncode == 0, kept_two.stderr
    assert [r["id"] for r in flat(json.loads(kept_two.stdout))["removed"]] == [first]
    assert not (runs_dir / first).exists() and (runs_dir / second).exists()

    # KEEP 0: every ended run goes, the running (active) one stays and keeps running.
    everything = prune("0", "--yes")
    assert everything.returncode == 0, everything.stderr
    assert "removed 1 of 2 runs" in everything.stderr and "kept 1 older" in everything.stderr
    assert sorted(p.name for p in runs_dir.iterdir()) == [third]
    assert ct_pid_alive(container, launched[-1]["pid"])
    nothing = prune("0", "--yes")
    assert nothing.returncode == 0 and "nothing to prune" in nothing.stderr


def test_runs_prune_refuses_bad_input_before_connecting(setup):
    path, _, _ = setup
    for args, message in (
        (["--prune", "-1"], "KEEP must be 0 or more"),
        (["--yes"], "--yes and --dry-run go with --prune KEEP"),
    ):
        result = subprocess.run(
            [*DFLASHCTL, "runs", "-c", str(path), *args],
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
        )
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_two_workdirs_in_one_container_never_stop_each_others_runs(setup, write_config):
    """`stop -c other.yaml` (another workdir, nothing deployed there) stops nothing of
    /root/dflash; a deploy there stops only its own runs."""
    path, source, container = setup
    mine = detached(path)
    wait_started(container, mine)
    other = write_config(
        path.parent / "other.yaml",
        trainer_source=source,
        **{
            "container.workdir": "/root/fresh",
            "trainer.entry": "train.py",
            "trainer.args": ["--sleep", "60", "--on-term", "checkpoint"],
            "run.stop_grace_s": 3,
        },
    )
    assert stop(load_config(other))["stopped"] == []
    assert ct_pid_alive(container, mine["pid"])

    theirs = detached(other)
    assert theirs["runs_stopped"] == []
    again = detached(path)
    assert [s["pid"] for s in again["runs_stopped"]] == [mine["pid"]]
    assert ct_pid_alive(container, theirs["pid"])
    assert [s["pid"] for s in stop(load_config(other))["stopped"]] == [theirs["pid"]]
    assert ct_pid_alive(container, again["pid"])
