"""Following a run in a container of the test host, over the real sshd: lines, crashes,
and connections killed mid-stream (every line still printed exactly once, in order)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from rich.console import Console

from dflashctl.config.schema import load_config
from dflashctl.crash import load_rules
from dflashctl.errors import HostError
from dflashctl.follow import follow_run
from dflashctl.remote.connect import open_target
from tests.json_answers import flat
from tests.test_follow_support import expected_lines, launch_argv, trainer_argv, wait_for

pytestmark = pytest.mark.slow

WORKDIR = "/root/dflash"
RULES = load_rules()
# What a busy machine may take to start a follower or reconnect: a safety net only.
PATIENCE_S = 120


@pytest.fixture
def setup(tmp_path, container, write_config):
    path = write_config(tmp_path)
    return path, load_config(path), container


def launch_in(container, run_id: str, lines: int, delay: float, mode: str = "finish", holds=()):
    """Start the fake trainer detached in the container; the host path of its run folder.
    holds: step numbers it waits before (release them with `release`)."""
    rundir = f"{WORKDIR}/runs/{run_id}"
    gate = None
    if holds:
        gate = f"/tmp/gate-{run_id}"
        host_gate = container.host_path(gate)
        host_gate.mkdir(parents=True, exist_ok=True)
        for step in holds:
            (host_gate / f"hold-{step}").write_text("")
    argv = trainer_argv(sys.executable, lines, delay, mode, gate)
    done = container.exec(launch_argv(rundir, argv))
    assert done.returncode == 0, done.stderr
    host_rundir = container.host_path(rundir)
    wait_for(lambda: (host_rundir / "pid").exists(), what="the pid file")
    return host_rundir


def log_has(host_rundir, text: str) -> bool:
    try:
        return text in (host_rundir / "train.log").read_text()
    except FileNotFoundError:
        return False


def readers_in(container) -> list[str]:
    return [cmd for _, cmd in container.ps() if "DFLASH-LOG" in cmd]


def reader_pids(container) -> list[int]:
    return [pid for pid, cmd in container.ps() if "DFLASH-LOG" in cmd]


def step_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("step ", "training complete"))]


def follow(config, run_id: str, reconnects: list | None = None, **kwargs):
    """follow_run over SSH; `reconnects` collects one entry per reconnection made."""
    out = io.StringIO()
    target = open_target(config)

    def reconnect():
        if reconnects is not None:
            reconnects.append(time.monotonic())
        return open_target(config)

    try:
        result = follow_run(
            reconnect,
            config.container.workdir,
            run_id,
            rules=RULES,
            target=target,
            python=config.container.python,
            console=Console(file=out, width=200),
            **kwargs,
        )
    finally:
        target.transport.close()
    return result, out.getvalue()


def held_after(marks: list[str]) -> list[int]:
    """The steps a run waits before, one after each mark (`step 20/80` holds step 21)."""
    return [int(mark.split()[1].split("/")[0]) + 1 for mark in marks]


class Dropper(threading.Thread):
    """Kills every SSH connection of the test host at each mark of the log, each time
    once a new log reader is streaming (so every drop cuts a live stream). The run waits
    after each mark (launch_in's holds) until that drop is done: however slow the
    machine, every drop comes where it was meant to, while the run goes on."""

    def __init__(self, pve_host, container, host_rundir, marks: list[str], run_id: str):
        super().__init__(name="dropper", daemon=True)
        self.pve_host, self.container = pve_host, container
        self.host_rundir, self.marks = host_rundir, marks
        self.gate = container.host_path(f"/tmp/gate-{run_id}")
        self.killed: list[int] = []

    def run(self) -> None:
        seen: set[int] = set()
        try:
            for mark, held in zip(self.marks, held_after(self.marks), strict=True):
                wait_for(
                    lambda s=seen: set(reader_pids(self.container)) - s,
                    timeout=PATIENCE_S,
                    what="a reader",
                )
                seen |= set(reader_pids(self.container))
                wait_for(lambda m=mark: log_has(self.host_rundir, m), timeout=PATIENCE_S, what=mark)
                self.killed.append(self.pve_host.drop_connections())
                (self.gate / f"hold-{held}").unlink()
        finally:
            for hold in self.gate.glob("hold-*"):  # never leave the run waiting
                hold.unlink()


def test_follows_a_crash_in_the_container(setup):
    _, config, container = setup
    launch_in(container, "ssh-crash", lines=5, delay=0.02, mode="thread-crash")
    result, out = follow(config, "ssh-crash")
    assert step_lines(out) == expected_lines(5, "thread-crash")
    assert (result.status, result.exit_code) == ("crashed", 1)
    assert result.crashes[0].thread == "drafter-2"
    wait_for(lambda: not readers_in(container), timeout=PATIENCE_S, what="the log reader to exit")


def test_dropped_connections_lose_and_repeat_nothing(setup, pve_host):
    _, config, container = setup
    marks = ["step 10/80", "step 35/80", "step 60/80"]
    host_rundir = launch_in(
        container, "ssh-drops", lines=80, delay=0.03, mode="split", holds=held_after(marks)
    )
    dropper = Dropper(pve_host, container, host_rundir, marks, "ssh-drops")
    dropper.start()
    result, out = follow(config, "ssh-drops")
    dropper.join(timeout=PATIENCE_S)
    assert len(dropper.killed) == 3 and all(dropper.killed), dropper.killed
    assert step_lines(out) == expected_lines(80, "split")
    assert (result.status, result.exit_code) == ("finished", 0)
    # The readers of the cut connections noticed nobody reads them any more.
    wait_for(lambda: not readers_in(container), timeout=PATIENCE_S, what="the log readers to exit")


def test_cli_follow_across_drops_with_json(setup, pve_host):
    path, _, container = setup
    marks = ["step 20/80", "step 50/80"]
    host_rundir = launch_in(container, "ssh-cli", lines=80, delay=0.05, holds=held_after(marks))
    dropper = Dropper(pve_host, container, host_rundir, marks, "ssh-cli")
    dropper.start()
    done = subprocess.run(
        # -n past the log's length: a reader cut before its first frame came back (a
        # busy machine) starts the backlog later, and the last 50 would begin mid-log.
        [sys.executable, "-m", "dflashctl", "logs", "-f", "-n", "1000", "--json", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
    )
    dropper.join(timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr
    data = flat(json.loads(done.stdout))
    assert {k: data[k] for k in ("run", "status", "exit_code", "crashes")} == {
        "run": "ssh-cli",
        "status": "finished",
        "exit_code": 0,
        "crashes": [],
    }
    assert data["run_dir"] == "/root/dflash/runs/ssh-cli"
    assert data["summary"]["last_step"] == "80/80"
    assert step_lines(done.stderr) == expected_lines(80)
    assert "reconnecting" in done.stderr
    # A short line: what dropped, never the agent's command line.
    said = [line for line in done.stderr.splitlines() if "reconnecting" in line]
    assert all(len(line) < 120 and "`" not in line and " -c " not in line for line in said), said
    assert len(dropper.killed) == 2 and all(dropper.killed), dropper.killed


def test_ctrl_c_over_ssh_leaves_the_run_and_no_reader(setup):
    path, _, container = setup
    # The run logs its lines, then stays alive until killed: however slowly the
    # follower starts on a busy machine, the run is still running when Ctrl-C comes.
    host_rundir = launch_in(container, "ssh-int", lines=10_000, delay=0.02, mode="hang")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "logs", "-f", "ssh-int", "-c", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
    )
    printed: list[str] = []
    errors: list[str] = []
    collectors = [
        threading.Thread(target=lambda: printed.extend(proc.stdout), daemon=True),
        threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True),
    ]
    for collector in collectors:
        collector.start()
    try:
        wait_for(lambda: log_has(host_rundir, "step 20/"), PATIENCE_S, "the log")
        wait_for(lambda: readers_in(container), PATIENCE_S, "the log reader")
        # Interrupt once the last 50 lines are out and live lines follow.
        wait_for(lambda: step_lines("".join(printed)), PATIENCE_S, "the first lines")
        shown_first = len(step_lines("".join(printed)))
        wait_for(
            lambda: len(step_lines("".join(printed))) > shown_first + 5, PATIENCE_S, "live lines"
        )
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        for collector in collectors:
            collector.join(10)
        out, err = "".join(printed), "".join(errors)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "dflashctl logs -f ssh-int" in err
    # The last 50 lines at the start, then every line until Ctrl-C: no gap, no repeat.
    shown, everything = step_lines(out), expected_lines(10_000, "hang")
    first = everything.index(shown[0])
    assert len(shown) > 5 and shown == everything[first : first + len(shown)]
    assert not (host_rundir / "exit_code").exists()
    # The trainer (its source is on its command line) is still running.
    assert any("training complete" in cmd for _, cmd in container.ps())
    wait_for(lambda: not readers_in(container), timeout=PATIENCE_S, what="the log reader to exit")


def test_a_container_stopped_mid_run_ends_the_following_with_a_clear_error(setup):
    _, config, container = setup
    host_rundir = launch_in(container, "ssh-stop", lines=300, delay=0.02, mode="hang")

    def stop_later():
        # Under the follower's live stream: once its reader streams the log.
        wait_for(lambda: log_has(host_rundir, "step 20/"), PATIENCE_S, "the log")
        wait_for(lambda: readers_in(container), PATIENCE_S, "the log reader")
        container.stop()

    stopper = threading.Thread(target=stop_later)
    stopper.start()
    reconnects: list[float] = []
    with pytest.raises(HostError) as caught:
        follow(config, "ssh-stop", reconnects)
    stopper.join()
    # A stopped container is final: no minutes of reconnecting (at most the one attempt
    # that found it stopped, when the stop cut the stream first).
    assert len(reconnects) <= 1, reconnects
    assert (
        caught.value.message
        == "container 200 is not running, so run ssh-stop is not running either"
    )
    assert caught.value.exit_code == 3 and "pct start 200" in caught.value.hint


def test_a_wrong_container_python_fails_at_once_not_as_a_dropped_connection(
    tmp_path, container, write_config
):
    launch_in(container, "ssh-python", lines=400, delay=0.05)
    path = write_config(tmp_path, **{"container.python": "/nonexistent/python3"})
    done = subprocess.run(
        [sys.executable, "-m", "dflashctl", "logs", "-f", "ssh-python", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert done.returncode == 3, done.stderr
    assert "/nonexistent/python3" in done.stderr and "reconnecting" not in done.stderr
