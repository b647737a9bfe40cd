"""`dflashctl logs` over a fleet on this machine (a workdir per node, `host: local`),
for one node and for two: which run is followed (node 0's active run; another node's is
said), a node without the run, a plain `logs` of every log (prefixed with the node only
when there are several), the JSON, and Ctrl-C leaving the runs alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import yaml

from tests.json_answers import flat
from tests.test_follow_support import (
    expected_lines,
    kill_run,
    launch_argv,
    trainer_argv,
    wait_for,
)


class Fleet:
    """Nodes named by `names` (a, b, ...): a workdir each on this machine; runs started in
    them are killed after."""

    def __init__(self, tmp_path, names: str = "ab"):
        self.workdirs = {name: tmp_path / name for name in names}
        self.config = tmp_path / "dflash.yaml"
        nodes = [
            {"name": name, "host": "local", "container": {"vmid": None, "workdir": str(path)}}
            for name, path in self.workdirs.items()
        ]
        self.config.write_text(
            yaml.safe_dump({"container": {"python": sys.executable}, "nodes": nodes})
        )
        self.rundirs = []

    def start(self, node: str, run_id: str, lines: int, delay: float, mode: str = "finish"):
        rundir = self.workdirs[node] / "runs" / run_id
        self.rundirs.append(rundir)
        subprocess.run(launch_argv(str(rundir), trainer_argv(sys.executable, lines, delay, mode)))
        wait_for(lambda: (rundir / "pid").exists(), what="the pid file")
        return rundir

    def logs(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dflashctl", "logs", "-c", str(self.config), *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "NO_COLOR": "1"},
        )


@pytest.fixture
def two(tmp_path):
    nodes = Fleet(tmp_path, "ab")
    yield nodes
    for rundir in nodes.rundirs:
        kill_run(rundir)


@pytest.fixture(params=["a", "ab"], ids=["1-node", "2-nodes"])
def fleet(request, tmp_path):
    nodes = Fleet(tmp_path, request.param)
    yield nodes
    for rundir in nodes.rundirs:
        kill_run(rundir)


def of_node(text: str, node: str) -> list[str]:
    prefix = f"{node} | "
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


def test_plain_logs_show_every_nodes_lines_prefixed(two):
    for node in ("a", "b"):
        rundir = two.start(node, "r1", 4, 0.0)
        wait_for(lambda r=rundir: (r / "exit_code").exists(), what="the run's end")
    done = two.logs("r1")
    assert done.returncode == 0, done.stderr
    assert of_node(done.stdout, "a") == expected_lines(4) == of_node(done.stdout, "b")
    assert "run r1 finished on all 2 nodes" in done.stderr


def test_one_node_or_two_the_same_lines_prefixed_only_for_two(fleet):
    for node in fleet.workdirs:
        rundir = fleet.start(node, "r1", 3, 0.0)
        wait_for(lambda r=rundir: (r / "exit_code").exists(), what="the run's end")
    done = fleet.logs("-f")
    assert done.returncode == 0, done.stderr
    if len(fleet.workdirs) == 1:
        assert [line for line in done.stdout.splitlines() if line] == expected_lines(3)
        assert "run r1 finished (exit code 0)" in done.stderr
    else:
        assert of_node(done.stdout, "a") == expected_lines(3) == of_node(done.stdout, "b")
        assert "run r1 finished on all 2 nodes" in done.stderr


def test_the_json_of_one_node_or_two_has_the_same_keys(fleet):
    for node in fleet.workdirs:
        fleet.start(node, "r1", 2, 0.0, "thread-crash")
    done = fleet.logs("-f", "--json", "r1")
    assert done.returncode == 1, done.stderr
    answer = json.loads(done.stdout)
    assert set(answer) == {"schema_version", "command", "run", "status", *FOLLOW_KEYS}
    assert (answer["run"], answer["status"]) == ("r1", "crashed")
    assert [n["node"] for n in answer["nodes"]] == list(fleet.workdirs)
    assert answer["root_cause"]["thread"] == "drafter-2"
    assert answer["nodes"][0]["crashes"][0]["thread"] == "drafter-2"


# Besides `run` and `status`: what a follow answer has, for one node as for several.
FOLLOW_KEYS = {"nodes", "root_cause", "consequences"}


def test_one_follower_answers_one_node_and_two_with_the_same_keys(tmp_path):
    """follow_fleet itself, on a fleet of one node and one of two: one path, one shape."""
    from dflashctl.config.schema import load_config
    from dflashctl.crash import load_rules
    from dflashctl.follow import follow_fleet
    from dflashctl.remote.nodes import node_sessions

    answers = []
    for names in ("a", "ab"):
        (tmp_path / names).mkdir()
        fleet = Fleet(tmp_path / names, names)
        try:
            for node in names:
                fleet.start(node, "r1", 2, 0.0, "thread-crash")
            with node_sessions(load_config(fleet.config)) as nodes:
                result = follow_fleet(nodes, "r1", rules=load_rules(), show_lines=False)
        finally:
            for rundir in fleet.rundirs:
                kill_run(rundir)
        assert (result.status, result.cli_exit_code) == ("crashed", 1)
        answers.append(result.to_json())
    one, two = answers
    assert set(one) == set(two) == {"run", "status", *FOLLOW_KEYS}
    assert [set(entry) for entry in two["nodes"]] == [set(one["nodes"][0])] * 2
    assert set(one["root_cause"]) == set(two["root_cause"])


def test_the_active_run_of_node_0_is_followed_and_another_one_said(two):
    two.start("a", "r1", 3, 0.0)
    two.start("b", "r1", 3, 0.0)
    two.start("b", "r2", 1, 0.0)  # node b's active run is now r2
    done = two.logs("-f")
    assert done.returncode == 0, done.stderr
    assert "node b's active run is r2, not r1 (node a's); following r1 on every node" in (
        done.stderr
    )
    assert of_node(done.stdout, "b") == expected_lines(3)


def test_a_node_without_the_run_is_named(two):
    two.start("a", "r1", 2, 0.0)
    done = two.logs("-f", "r1")
    assert done.returncode == 2, done.stderr
    assert f"node b (this machine) has no run r1 in {two.workdirs['b']}/runs" in done.stderr
    assert "Traceback" not in done.stderr


def test_ctrl_c_stops_following_every_node_and_leaves_the_runs(two):
    rundirs = [two.start(node, "r1", 10_000, 0.02, "hang") for node in ("a", "b")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "logs", "-f", "-c", str(two.config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
    )
    printed: list[str] = []
    reader = threading.Thread(target=lambda: printed.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        # Live lines of both nodes: more of each after the first ones came (a follower
        # that started late on a busy machine shows only the last lines of each first).
        def counts():
            return [sum(line.startswith(f"{n} | step ") for line in printed) for n in "ab"]

        wait_for(lambda: all(counts()), timeout=120, what="lines of both nodes")
        first = counts()
        wait_for(
            lambda: all(now > then for now, then in zip(counts(), first, strict=True)),
            timeout=120,
            what="live lines of both nodes",
        )
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "stopped following; run r1 keeps running on its 2 nodes" in err
    assert "Traceback" not in err
    assert not any((rundir / "exit_code").exists() for rundir in rundirs)


def test_deploy_follows_the_new_run_on_one_node_or_two(fleet, capsys):
    """What deploy and restart call after launching, for a fleet of one node or two."""
    from dflashctl.config.schema import load_config
    from dflashctl.crash import load_rules
    from dflashctl.ops.launching import follow_unless_detached
    from dflashctl.remote.nodes import node_sessions

    for node in fleet.workdirs:
        fleet.start(node, "r1", 2, 0.01)
    with node_sessions(load_config(fleet.config)) as nodes:
        code, summary = follow_unless_detached(nodes, load_rules(), {"run_id": "r1"}, detach=False)
    assert code == 0
    result = summary["result"]
    assert set(result) == {"run", "status", *FOLLOW_KEYS}
    assert [(n["status"], n["exit_code"]) for n in result["nodes"]] == [("finished", 0)] * len(
        fleet.workdirs
    )
    out = capsys.readouterr().out
    prefix = "a | " if len(fleet.workdirs) > 1 else ""
    assert f"{prefix}{expected_lines(2)[-1]}" in out.splitlines()


def test_deploy_follows_the_new_run_on_every_node(two, capsys):
    """What deploy and restart call after launching on several nodes."""
    from dflashctl.config.schema import load_config
    from dflashctl.crash import load_rules
    from dflashctl.ops.launching import follow_unless_detached
    from dflashctl.remote.nodes import node_sessions
    from dflashctl.ui.terminal import TerminalReporter

    two.start("a", "r1", 3, 0.01)
    two.start("b", "r1", 2, 0.01, "thread-crash")
    with node_sessions(load_config(two.config)) as nodes:
        code, summary = follow_unless_detached(nodes, load_rules(), {"run_id": "r1"}, detach=False)
        detached = follow_unless_detached(
            nodes, load_rules(), {"run_id": "r1"}, detach=True, report=TerminalReporter()
        )
        assert detached == (0, {"run_id": "r1"})
    assert code == 1
    cause = summary["result"]["root_cause"]
    assert (cause["node"], cause["thread"], cause["exception"]) == (
        "b",
        "drafter-2",
        "AssertionError",
    )
    assert [n["status"] for n in summary["result"]["nodes"]] == ["finished", "crashed"]
    err = capsys.readouterr().err
    assert "root cause (the first failure in time): node b, thread drafter-2 on cpu" in err
    assert "dflashctl logs -f r1" in err


# torchrun on a node where one of two local ranks was SIGKILLed: it stops the other
# rank first (its grace period: here until the file ranks-stopped appears) and names
# the failed rank only then, in its failure summary.
TORCHRUN_LIKE = r"""
import os, sys, time
for i in range(1, 4):
    print(f"step {i}/100", flush=True)
print("W1130 21:10:00.000000 42 torch/distributed/elastic/multiprocessing/api.py:1031] "
      "Sending process 43 closing signal SIGTERM", flush=True)
while not os.path.exists("ranks-stopped"):
    time.sleep(0.05)
for line in [
    "E1130 21:10:05.000000 42 torch/distributed/elastic/multiprocessing/api.py:1002] "
    "failed (exitcode: -9) local_rank: 1 (pid: 44) of binary: python",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "============================================================",
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2026-11-30_21:10:05",
    "  rank      : 3 (local_rank: 1)",
    "  exitcode  : -9 (pid: 44)",
    "  traceback : Signal 9 (SIGKILL) received by PID 44",
    "============================================================",
]:
    print(line, flush=True)
sys.exit(1)
"""


def test_torchrun_stopping_a_nodes_other_ranks_is_reported_before_it_names_the_rank(two):
    a_rundir = two.start("a", "r1", 5, 0.01, "hang")
    b_rundir = two.workdirs["b"] / "runs" / "r1"
    two.rundirs.append(b_rundir)
    subprocess.run(launch_argv(str(b_rundir), [sys.executable, "-u", "-c", TORCHRUN_LIKE]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "logs", "-f", "r1", "--json", "-c", str(two.config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
    )
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any(e.startswith("✗ node b") for e in errors), 120, "node b's report")
        assert not (b_rundir / "exit_code").exists()  # said while torchrun still waits
        report = next(e for e in errors if e.startswith("✗ node b"))
        assert report.startswith("✗ node b: a rank failed; torchrun is stopping the node's")
        (b_rundir / "ranks-stopped").write_text("")
        wait_for(lambda: (b_rundir / "exit_code").exists(), what="node b's end")
        kill_run(a_rundir)
        out = proc.stdout.read()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    assert proc.returncode == 1, "".join(errors)
    cause = flat(json.loads(out))["root_cause"]
    assert (cause["node"], cause["rank"], cause["summary"]) == ("b", 3, "killed by SIGKILL, pid 44")
    assert any(e.startswith("✗ node b, rank 3: killed by SIGKILL, pid 44") for e in errors)
