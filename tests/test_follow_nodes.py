"""`logs -f` across nodes: two real containers of the test host (and this machine as a
node of its own) run a stand-in trainer under the same run id; every line once, prefixed
with its node; a rank killed by hand reported (how fast: bench/bench_nodes_failure.py)
with what the other node is
doing; the first failure in time named as the root cause; one node's dropped connection
while the other streams on."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from dflashctl.config.schema import load_config
from dflashctl.crash import load_rules
from dflashctl.follow.fleet import follow_fleet
from dflashctl.follow.fleet_report import report_fleet
from dflashctl.remote.nodes import node_sessions
from dflashctl.ui import terminal
from tests.json_answers import flat
from tests.test_follow_support import kill_run, launch_argv, wait_for

pytestmark = pytest.mark.slow

WORKDIR = "/root/dflash"
RUN = "20261130-210000-a1b2"

# A rank of the job. argv: LINES DELAY MODE [GATE]
# GATE, a folder: step line i waits while GATE/hold-i exists (the test decides when the
# run goes on, instead of racing it with the clock).
#   finish  LINES step lines, then "training complete", exit 0
#   split   like finish, each line written in two halves DELAY apart
#   peer    step lines until a file peer-down appears in its run folder, then the
#           trainer's PeerFailure for a silent rank 1 (what rank 0 says when rank 1 was
#           killed), exit 1
#   hang    step lines until killed
NODE_TRAINER = r"""
import os, sys, time
lines, delay, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
gate = sys.argv[4] if len(sys.argv) > 4 else None
i = 0
while mode in ("peer", "hang") or i < lines:
    i += 1
    while gate and os.path.exists(os.path.join(gate, f"hold-{i}")):
        time.sleep(0.01)
    if mode == "peer" and os.path.exists("peer-down"):
        for text in [
            "peers failed:",
            "Traceback (most recent call last):",
            '  File "/root/dflash/current/dflash/pipeline/distributed.py", line 200, in _watch',
            "    self._fail(text)",
            "dflash.pipeline.distributed.PeerFailure: rank 0/2 on host a (pid 7): rank 1 on "
            "host b stopped answering: no heartbeat for 15 s",
        ]:
            print(text, flush=True)
        sys.exit(1)
    text = f"step {i}/{lines} | loss 2.5000 | acc 0.50"
    if mode == "split":
        sys.stdout.write(text[:9]); sys.stdout.flush(); time.sleep(delay)
        print(text[9:], flush=True)
    else:
        print(text, flush=True)
        time.sleep(delay)
print("training complete", flush=True)
"""


# Like tests/test_follow_support.py's LAUNCH, but the wrapper is a Python process that
# says nothing when the trainer dies (as the run's supervisor: no shell's "Killed"), so
# a killed rank is known only from the run's end, as in a real run.
QUIET_LAUNCH = r"""
rundir=$1; python=$2; shift 2
mkdir -p "$rundir"
cd "$rundir" || exit 1
basename "$rundir" > ../../active_run
DFLASH_RUN_ID=$(basename "$rundir") setsid "$python" -c '
import os, subprocess, sys
with open("pid", "w") as f:
    f.write(f"{os.getpid()}\n")
with open("train.log", "ab") as log:
    code = subprocess.call(sys.argv[1:], stdout=log, stderr=subprocess.STDOUT)
with open("exit_code.tmp", "w") as f:
    f.write(f"{128 - code if code < 0 else code}\n")
os.rename("exit_code.tmp", "exit_code")
' "$@" </dev/null >/dev/null 2>&1 &
"""


def trainer(lines: int, delay: float, mode: str, gate: Path | None = None) -> list[str]:
    argv = [sys.executable, "-u", "-c", NODE_TRAINER, str(lines), str(delay), mode]
    return argv + ([str(gate)] if gate is not None else [])


def held_at(gate: Path, step: int) -> Path:
    """The run waits before step `step` until the returned file is removed."""
    gate.mkdir(parents=True, exist_ok=True)
    hold = gate / f"hold-{step}"
    hold.write_text("")
    return hold


def steps(lines: int) -> list[str]:
    return [f"step {i}/{lines} | loss 2.5000 | acc 0.50" for i in range(1, lines + 1)]


def of_node(text: str, prefix: str) -> list[str]:
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


def step_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(("step ", "training complete"))]


def launch_in(
    container, lines: int, delay: float, mode: str, *, quiet: bool = False, hold: int = 0
) -> Path:
    """Start a rank in the container; with `hold`, it waits before that step until the
    container's /tmp/gate/hold-N is removed."""
    rundir = f"{WORKDIR}/runs/{RUN}"
    gate = None
    if hold:
        held_at(container.host_path("/tmp/gate"), hold)
        gate = Path("/tmp/gate")
    argv = trainer(lines, delay, mode, gate)
    if quiet:
        argv = ["sh", "-c", QUIET_LAUNCH, "sh", rundir, sys.executable, *argv]
    else:
        argv = launch_argv(rundir, argv)
    done = container.exec(argv)
    assert done.returncode == 0, done.stderr
    host_rundir = container.host_path(rundir)
    wait_for(lambda: (host_rundir / "pid").exists(), what="the pid file")
    return host_rundir


def trainer_pid(container) -> int:
    """The host pid of the stand-in trainer in the container (not its shell wrapper)."""
    for pid in container.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-u", b"-c"]:
            return pid
    raise AssertionError("no trainer in the container")


@pytest.fixture
def two_containers(tmp_path, make_container, write_config):
    """Nodes a and b: containers 200 and 201 of the test host (one SSH connection)."""
    a, b = make_container(200), make_container(201)
    path = write_config(
        tmp_path, nodes=[{"name": "a", "container": 200}, {"name": "b", "container": 201}]
    )
    return path, a, b


class Collected(threading.Thread):
    """Collects the lines of a process's stdout or stderr with the time each arrived."""

    def __init__(self, stream):
        super().__init__(name="collector", daemon=True)
        self.stream, self.lines = stream, []
        self.start()

    def run(self):
        for line in self.stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, start: str):
        return next(((t, text) for t, text in self.lines if text.startswith(start)), None)

    def text(self) -> str:
        return "\n".join(text for _, text in self.lines)


def streaming(printed: Collected) -> bool:
    """Both nodes' step lines are coming (whichever step: a follower that started late on
    a busy machine shows only the last lines of each log first)."""
    return bool(printed.first("a | step ") and printed.first("b | step "))


def cli(path, *args, **kwargs):
    return subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "logs", "-f", "-c", str(path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"},
        **kwargs,
    )


def test_every_node_followed_to_the_end_with_prefixed_lines(two_containers):
    path, a, b = two_containers
    launch_in(a, 30, 0.02, "finish")
    launch_in(b, 20, 0.03, "finish")
    done = subprocess.run(
        [sys.executable, "-m", "dflashctl", "logs", "-f", "-n", "100", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert step_lines(of_node(done.stdout, "a | ")) == [*steps(30), "training complete"]
    assert step_lines(of_node(done.stdout, "b | ")) == [*steps(20), "training complete"]
    assert all(line.startswith(("a | ", "b | ")) for line in done.stdout.splitlines())
    assert f"run {RUN} finished on all 2 nodes" in done.stderr
    assert f"{WORKDIR}/runs/{RUN}" in done.stderr


def test_a_rank_killed_by_hand_is_reported_while_the_other_still_runs(two_containers):
    """Node b's trainer is SIGKILLed: the report names node b and says what node a is
    doing, while a still runs (the report does not wait for a's own failure); node a
    then stops with the trainer's PeerFailure, and b stays the root cause (the first
    failure in time), a its consequence. How fast: bench/bench_nodes_failure.py."""
    path, a, b = two_containers
    a_rundir = launch_in(a, 1000, 0.05, "peer", quiet=True)
    launch_in(b, 1000, 0.05, "hang", quiet=True)
    proc = cli(path, "--json")
    errors = Collected(proc.stderr)
    try:
        wait_for(lambda: streaming(errors) or proc.poll() is not None, 120, "lines of both")
        assert proc.poll() is None, errors.text()
        os.kill(trainer_pid(b), signal.SIGKILL)
        wait_for(lambda: errors.first("✗ node b"), 120, "the report of node b")
        _, report = errors.first("✗ node b")
        assert "killed" in report.lower() or "SIGKILL" in report, report
        doing = errors.lines[[text for _, text in errors.lines].index(report) + 1][1]
        assert doing.startswith("  a: running, last line "), errors.text()
        assert "s ago: step " in doing
        (a_rundir / "peer-down").write_text("")
        out = proc.stdout.read()  # not communicate(): `errors` reads stderr
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    errors.join(10)
    assert proc.returncode == 1, errors.text()
    data = flat(json.loads(out))
    assert data["status"] == "crashed"
    assert data["root_cause"]["node"] == "b" and data["root_cause"]["category"] == "killed"
    [then] = data["consequences"]
    assert (then["node"], then["category"], then["consequence"]) == ("a", "peer_lost", True)
    assert [n["status"] for n in data["nodes"]] == ["crashed", "crashed"]
    # Node a's own failure came later and says so: not a second root cause.
    said = errors.first("✗ node a")[1]
    assert said.startswith("✗ node a, thread peers: dflash.pipeline.distributed.PeerFailure: ")
    assert said.endswith("(stopped by another rank's failure)")
    assert "crash peer_lost (consequence, rule peer_rank_lost)" in errors.text()


def test_one_nodes_dropped_connection_reconnects_while_the_other_streams_on(
    tmp_path, container, write_config, pve_host, monkeypatch
):
    """Node a is a container over SSH, node b this machine: cutting the SSH connection
    makes a reconnect (no line lost or repeated) while b's lines keep coming. Each run
    waits at a step of its own until the test lets it go on, and node a's reconnection
    waits for a line of node b: however slow the machine, the drop cuts a live stream
    and b's lines come while a reconnects."""
    b_workdir = tmp_path / "b-workdir"
    path = write_config(
        tmp_path,
        nodes=[
            {"name": "a", "container": 200},
            {"name": "b", "host": "local", "container": {"vmid": None, "workdir": str(b_workdir)}},
        ],
    )
    launch_in(container, 60, 0.03, "split", hold=21)
    a_hold = container.host_path("/tmp/gate/hold-21")
    b_rundir = b_workdir / "runs" / RUN
    b_hold = held_at(tmp_path / "b-gate", 31)
    subprocess.run(
        launch_argv(str(b_rundir), trainer(150, 0.02, "split", tmp_path / "b-gate")), check=True
    )
    out = io.StringIO()
    printed: list[tuple[float, str]] = []

    class Stamped(io.StringIO):
        def write(self, text):
            for line in text.splitlines():
                printed.append((time.monotonic(), line))
            return out.write(text)

    console = Console(file=Stamped(), width=200)
    monkeypatch.setattr(terminal, "err", Console(file=Stamped(), width=200))

    def lost_at() -> int | None:
        said = [i for i, (_, t) in enumerate(printed) if "node a: lost the log stream" in t]
        return said[0] if said else None

    def b_after_loss() -> bool:
        at = lost_at()
        return at is not None and any(t.startswith("b | ") for _, t in printed[at + 1 :])

    from dflashctl.remote import connect

    real_open = connect.open_target

    def open_target(config):
        if config.container.vmid == 200 and lost_at() is not None:
            wait_for(b_after_loss, 120, "a line of node b after node a's drop")
        return real_open(config)

    monkeypatch.setattr(connect, "open_target", open_target)

    def drop():
        # Both runs wait at their step (a before 21, b before 31): cut node a's live
        # stream, then let both go on; b's lines come while a reconnects.
        wait_for(lambda: any(t.startswith("a | step 20/") for _, t in printed), 120, "a's step 20")
        wait_for(lambda: any(t.startswith("b | step 30/") for _, t in printed), 120, "b's step 30")
        try:
            pve_host.drop_connections()
            wait_for(lambda: lost_at() is not None, 120, "node a's lost stream")
        finally:
            a_hold.unlink()
            b_hold.unlink()

    dropper = threading.Thread(target=drop, daemon=True)
    dropper.start()
    try:
        config = load_config(path)
        with node_sessions(config) as nodes:
            result = follow_fleet(
                nodes,
                RUN,
                rules=load_rules(),
                console=lambda: console,
            )
    finally:
        kill_run(b_rundir)
    dropper.join(5)
    assert result.cli_exit_code == 0 and result.status == "finished"
    text = out.getvalue()
    assert step_lines(of_node(text, "a | ")) == [*steps(60), "training complete"]
    assert step_lines(of_node(text, "b | ")) == [*steps(150), "training complete"]
    lost = [t for t, line in printed if "node a: lost the log stream" in line]
    back = [t for t, line in printed if "node a: reconnected" in line]
    assert lost and back, text
    assert not any("node b: lost" in line for _, line in printed)
    during = [line for t, line in printed if lost[0] < t < back[0] and line.startswith("b | ")]
    assert during, "node b printed nothing while node a reconnected"
    assert report_fleet(result) == 0


def test_a_node_that_cannot_be_reached_is_named_while_the_other_is_followed_to_its_end(
    two_containers,
):
    """Container b stops under its run: following b ends with exit 3 naming node b;
    node a is followed to its end all the same."""
    path, a, b = two_containers
    launch_in(a, 60, 0.05, "finish")
    launch_in(b, 1000, 0.05, "hang")
    proc = cli(path, "--reconnect-timeout", "1")
    printed, errors = Collected(proc.stdout), Collected(proc.stderr)
    try:
        wait_for(lambda: streaming(printed) or proc.poll() is not None, 120, "lines of both")
        assert proc.poll() is None, errors.text()
        b.stop()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    errors.join(10)
    printed.join(10)
    text, out = errors.text(), printed.text()
    assert proc.returncode == 3, text
    assert "error: node b (CT 201 on " in text
    assert "step 60/60" in of_node(out, "a | ")[-2] and of_node(out, "a | ")[-1] == (
        "training complete"
    )
    assert f"run {RUN} could not be followed to its end on node b" in text
    assert "  b  unreachable: node b (CT 201" in text
    assert "Traceback" not in text
