"""stop, runs, status and doctor on one node and on two, each node a local workdir
(host: local): the real agent, real processes and signals; the CLI as a user runs it.
The same tests run for one node and for two where the answer has the same meaning."""

# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflashctl.config.schema import load_config
from dflashctl.ops.deploy import DeployOptions, deploy
from dflashctl.ops.launching import launch_params, stop_and_launch, trainer_command
from dflashctl.remote.nodes import node_sessions
from dflashctl.runs.records import new_id
from tests.json_answers import flat
from tests.test_deploy_support import kill_runs, pid_alive, wait_for, write_trainer

NAMES = ("gpu-a", "gpu-b")


class Nodes:
    """A project whose dflash.yaml names its nodes: a workdir on this machine each."""

    def __init__(self, root: Path, names: tuple[str, ...] = NAMES) -> None:
        self.root = root
        self.names = names
        write_trainer(root / "src")
        self.workdirs = [root / f"work-{name}" for name in names]
        self.config_path = root / "dflash.yaml"
        self.write()

    def write(self, **top) -> None:
        config = {
            "host": {"address": "local"},
            "container": {"vmid": None, "python": sys.executable},
            "nodes": [
                {"name": name, "container": {"workdir": str(workdir)}}
                for name, workdir in zip(self.names, self.workdirs, strict=True)
            ],
            # Runs until stopped (far longer than a test takes on a loaded machine).
            "trainer": {
                "source": "src",
                "entry": "train.py",
                "args": ["--sleep", "600", "--on-term", "checkpoint"],
            },
            "run": {"stop_grace_s": 3},
            **top,
        }
        self.config_path.write_text(yaml.safe_dump(config))

    def config(self):
        return load_config(self.config_path)

    def deploy_each(self) -> list[dict]:
        """A release and a run of its own on each node (each node deployed alone)."""
        config = self.config()
        summaries = []
        for index in range(len(self.names)):
            code, summary = deploy(config.for_node(index), DeployOptions(detach=True))
            assert code == 0
            summaries.append(summary)
        return summaries

    def launch_shared(self) -> str:
        """One run id on both nodes, each run's meta naming its node, as a multi-node
        launch records it."""
        config = self.config()
        run_id = new_id()
        with node_sessions(config) as nodes:
            for node in nodes:
                meta = {
                    "node": {
                        "name": node.name,
                        "rank": node.index,
                        "count": len(nodes),
                        "names": list(self.names),
                        "rendezvous": "127.0.0.1:29400",
                    }
                }
                command = trainer_command(node.config, [])
                params = launch_params(node.config, run_id, None, command, meta, by="restart")
                stop_and_launch(node.config, node.target, params)
        return run_id

    def run_dir(self, node: int, run_id: str) -> Path:
        return self.workdirs[node] / "runs" / run_id

    def pid(self, node: int, run_id: str) -> int:
        return int((self.run_dir(node, run_id) / "pid").read_text())


def make_project(tmp_path, monkeypatch, names: tuple[str, ...]):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    project = Nodes(tmp_path / "project", names)
    yield project
    for workdir in project.workdirs:
        kill_runs(workdir)


@pytest.fixture
def two(tmp_path, monkeypatch):
    yield from make_project(tmp_path, monkeypatch, NAMES)


@pytest.fixture(params=[1, 2], ids=["1 node", "2 nodes"])
def some(request, tmp_path, monkeypatch):
    """One node, then two: what a command says has the same meaning for both."""
    yield from make_project(tmp_path, monkeypatch, NAMES[: request.param])


def dflashctl(project: Nodes, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", *args, "-c", str(project.config_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def wait_started(project: Nodes, node: int, run_id: str) -> None:
    log = project.run_dir(node, run_id) / "train.log"
    wait_for(lambda: log.exists() and "hello" in log.read_text(), what=f"run on node {node}")


def test_stop_stops_the_run_on_every_node(some):
    some.deploy_each()
    run_id = some.launch_shared()
    count = len(some.names)
    pids = [some.pid(i, run_id) for i in range(count)]
    for index in range(count):
        wait_started(some, index, run_id)

    done = dflashctl(some, "stop", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert [n["node"] for n in answer["nodes"]] == list(some.names)
    for index, node in enumerate(answer["nodes"]):
        [stopped] = node["stopped"]
        assert (stopped["run_id"], stopped["pid"], stopped["ended"]) == (
            run_id,
            pids[index],
            "terminated",
        )
        assert node["error"] is None and node["target"] == "this machine"
        # The SIGTERM reached each node's trainer: it wrote its checkpoint.
        assert (some.run_dir(index, run_id) / "checkpointed").read_text() == "yes\n"
        assert not pid_alive(pids[index])
    again = dflashctl(some, "stop")
    assert again.returncode == 0, again.stderr
    if count == 1:  # one node: no node names, as before there were several
        assert "✓ stopped 1 run(s)  " in done.stderr
        assert f"\n  stopped run {run_id} (pid {pids[0]})" in done.stderr
        assert "✓ nothing to stop on this machine  " in again.stderr
        return
    assert "stopped 2 run(s) on 2 of 2 nodes" in done.stderr
    for name in NAMES:
        assert f"  {name}: stopped run {run_id}" in done.stderr
    assert "gpu-a: nothing to stop on this machine" in again.stderr
    assert "gpu-b: nothing to stop on this machine" in again.stderr


def test_runs_lists_a_shared_run_once_with_a_row_per_node(two):
    first_a, first_b = two.deploy_each()
    run_id = two.launch_shared()

    done = dflashctl(two, "runs")
    assert done.returncode == 0, done.stderr
    header, *lines = done.stdout.splitlines()
    assert header.split() == ["run", "node", "release", "started", "(UTC)", "continues", "state"]
    width = header.index("node")
    groups: dict[str, list[tuple[str, str]]] = {}
    for line in lines:
        cell = line[:width].strip()
        if cell:  # a run's first row names it; the rows below without one are its nodes
            current = groups.setdefault(cell, [])
        node, state = line[width:].split()[0], line
        current.append((node, state))
    # Each node's own deploy: a run on one node; the shared run: one id, a row per node.
    assert {k: [n for n, _ in v] for k, v in groups.items()} == {
        first_a["run_id"]: ["gpu-a"],
        first_b["run_id"]: ["gpu-b"],
        f"* {run_id}": ["gpu-a", "gpu-b"],
    }
    assert all(line.endswith("running") for _, line in groups[f"* {run_id}"])
    assert "stopped by restart" in groups[first_a["run_id"]][0][1]

    as_json = flat(json.loads(dflashctl(two, "runs", "--json").stdout))
    per_node = {n["node"]: [r["id"] for r in n["runs"]] for n in as_json["nodes"]}
    assert per_node == {"gpu-a": [first_a["run_id"], run_id], "gpu-b": [first_b["run_id"], run_id]}
    assert as_json["nodes"][1]["runs"][1]["meta"]["node"]["rank"] == 1


def test_runs_prune_on_every_node(some):
    some.deploy_each()
    run_id = some.launch_shared()
    done = dflashctl(some, "runs", "--prune", "0", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert [n["node"] for n in answer["nodes"]] == list(some.names)
    for node in answer["nodes"]:
        assert [r["status"] for r in node["removed"]] == ["stopped"]
        assert node["spared"] == [run_id]  # the active run always stays
        assert node["dry_run"] is False and node["error"] is None
    for index in range(len(some.names)):
        assert [p.name for p in (some.workdirs[index] / "runs").iterdir()] == [run_id]
    place = "this machine" if len(some.names) == 1 else "gpu-a (this machine)"
    assert "removed 1 of 2 runs (" in done.stderr and f") on {place}" in done.stderr


def test_status_has_a_row_per_node(some):
    some.deploy_each()
    run_id = some.launch_shared()
    done = dflashctl(some, "status")
    assert done.returncode == 0, done.stderr
    report = json.loads(dflashctl(some, "status", "--json").stdout)
    assert [n["node"] for n in report["nodes"]] == list(some.names)
    assert all(n["release"] and n["error"] is None for n in report["nodes"])
    assert [n["active_run"]["id"] for n in report["nodes"]] == [run_id] * len(some.names)
    if len(some.names) == 1:  # one node: its lines, as before there were several
        host, run = done.stdout.splitlines()
        assert host.split() == ["host", "this", "machine", "(no", "container)"]
        assert run.startswith(f"run        {run_id}: running, pid ")
        return
    header, *rows = done.stdout.splitlines()
    assert header.split() == ["node", "where", "container", "release", "active", "run", "state"]
    assert [r.split()[0] for r in rows] == list(NAMES)
    for line in rows:
        assert run_id in line and line.endswith("running")
        assert "this machine" in line


def test_a_node_whose_python_fails_is_named_and_the_other_still_answers(two):
    (run_id,) = [s["run_id"] for s in two.deploy_each()[:1]]
    config = yaml.safe_load(two.config_path.read_text())
    config["nodes"][1]["container"]["python"] = "/opt/nowhere/python3"
    two.config_path.write_text(yaml.safe_dump(config))
    pid = two.pid(0, run_id)

    status = dflashctl(two, "status")
    assert status.returncode == 3
    assert status.stdout.splitlines()[1].split()[0] == "gpu-a"
    assert run_id in status.stdout.splitlines()[1]
    assert "error: node gpu-b (this machine) status: /opt/nowhere/python3" in status.stderr

    runs = dflashctl(two, "runs", "--json")
    assert runs.returncode == 3
    answer = flat(json.loads(runs.stdout))
    assert [r["id"] for r in answer["nodes"][0]["runs"]] == [run_id]
    assert answer["nodes"][1]["error"]["message"].startswith("/opt/nowhere/python3")
    assert "error: node gpu-b (this machine) listing runs:" in runs.stderr

    stop = dflashctl(two, "stop")
    assert stop.returncode == 3
    assert f"gpu-a: stopped run {run_id}" in stop.stderr
    assert "error: node gpu-b (this machine) stopping runs: /opt/nowhere/python3" in stop.stderr
    assert not pid_alive(pid)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_ports() -> dict[str, int]:
    """torchrun's port and the commit store's, both picked by the kernel. The commit
    port's default (port + 1) is nobody's pick: beside other tests' connections on
    127.0.0.1 it is now and then taken, and the deploy rightly refuses."""
    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", 0))
        second.bind(("127.0.0.1", 0))
        return {"port": first.getsockname()[1], "commit_port": second.getsockname()[1]}


def doctor_checks(project: Nodes) -> tuple[int, dict[str | None, dict[str, dict]]]:
    done = dflashctl(project, "doctor", "--json")
    by_node: dict[str | None, dict[str, dict]] = {}
    for check in flat(json.loads(done.stdout))["checks"]:
        by_node.setdefault(check.get("node"), {})[check["name"]] = check
    return done.returncode, by_node


def test_doctor_rendezvous_passes_between_two_workdirs_and_fails_on_a_taken_port(two):
    port = free_port()
    two.write(torchrun={"address": "127.0.0.1", "port": port})
    code, checks = doctor_checks(two)
    assert code == 0, checks
    assert set(checks) == {None, "gpu-a", "gpu-b"}
    assert checks["gpu-b"]["python"]["status"] == "pass"
    across = checks[None]
    assert across["rendezvous address"]["detail"] == "127.0.0.1 (torchrun.address)"
    assert across["rendezvous port"]["detail"] == (
        f"node gpu-a listens on port {port}; all 2 nodes reach 127.0.0.1:{port}"
    )

    with socket.socket() as holder:  # a run still holding the port, say
        # (as torchrun's store does: the probes just now left connections in TIME_WAIT)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("0.0.0.0", port))
        holder.listen(1)
        code, checks = doctor_checks(two)
    assert code == 3
    taken = checks[None]["rendezvous port"]
    assert taken["status"] == "fail"
    assert taken["detail"] == (
        f"node gpu-a cannot listen on port {port} in its container: Address already in use "
        "(a run still holding it?)"
    )
    assert "torchrun.port" in taken["fix"]

    text = dflashctl(two, "doctor")
    assert text.returncode == 0
    assert text.stdout.startswith("✓ config valid")
    assert "\nnode gpu-a\n  ✓ SSH reachable        host.address is local" in text.stdout
    assert "\nacross the nodes\n  ✓ rendezvous address" in text.stdout


def test_doctor_warns_when_the_nodes_have_different_release_files(two):
    two.write(torchrun={"address": "127.0.0.1", **job_ports()})
    two.deploy_each()
    code, checks = doctor_checks(two)
    agree = checks[None]["nodes agree"]
    assert code == 0 and agree["status"] == "pass"
    assert "the same release files (" in agree["detail"]  # two releases, the same files

    (two.root / "src" / "helpers.py").write_text("def greeting():\n    return 'changed'\n")
    code, _ = deploy(two.config().for_node(0), DeployOptions(detach=True))
    assert code == 0
    code, checks = doctor_checks(two)
    agree = checks[None]["nodes agree"]
    assert code == 0 and agree["status"] == "warn"
    assert agree["detail"].startswith("release differs: gpu-a ")
    assert ", gpu-b " in agree["detail"] and "sends every node the same release" in agree["detail"]


def test_prune_asks_once_for_every_node_and_runs_show_reads_the_first_node(two):
    two.deploy_each()
    run_id = two.launch_shared()
    refused = dflashctl(two, "runs", "--prune", "0")  # no terminal to ask on
    assert refused.returncode == 2
    assert "--prune would remove 2 run folders; nothing was removed" in refused.stderr
    assert "gpu-a (this machine)" in refused.stderr and "gpu-b (this machine)" in refused.stderr
    assert all(len(list((w / "runs").iterdir())) == 2 for w in two.workdirs)

    shown = dflashctl(two, "runs", "show", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    whole = json.loads(shown.stdout)
    assert [node["node"] for node in whole["nodes"]] == ["gpu-a"]  # the node it read
    answer = flat(whole)
    assert answer["target"] == "gpu-a (this machine)"
    assert answer["note"].startswith("metrics from the first node, gpu-a: rank 0 writes them")
    text = dflashctl(two, "runs", "show", run_id)
    assert "metrics from the first node, gpu-a" in text.stderr
    assert f"{run_id} on gpu-a (this machine)" in text.stdout


def test_a_torchrun_job_deployed_to_both_nodes_is_one_run_and_stop_ends_it_everywhere(two):
    """The real multi-node deploy: one torchrun job, one run id; `runs` and `status` show
    it on both nodes, and `stop` gives each node's trainer its SIGTERM."""
    two.write(torchrun={"nproc_per_node": 1, "address": "127.0.0.1", **job_ports()})
    deployed = dflashctl(two, "deploy", "--detach", "--json")
    assert deployed.returncode == 0, deployed.stderr
    run_id = flat(json.loads(deployed.stdout))["run_id"]
    for index in range(2):
        wait_started(two, index, run_id)  # past the rendezvous: the trainer runs

    runs = flat(json.loads(dflashctl(two, "runs", "--json").stdout))["nodes"]
    assert [[(r["id"], r["status"]) for r in n["runs"]] for n in runs] == [
        [(run_id, "running")],
        [(run_id, "running")],
    ]
    assert [n["runs"][0]["meta"]["node"]["rank"] for n in runs] == [0, 1]
    status = flat(json.loads(dflashctl(two, "status", "--json").stdout))["nodes"]
    assert [n["active_run"]["id"] for n in status] == [run_id, run_id]
    # The running job's rendezvous store holds the port: doctor says so, not a failure.
    code, checks = doctor_checks(two)
    port = checks[None]["rendezvous port"]
    assert code == 0 and port["status"] == "warn", port
    assert f"while run {run_id} runs there (its rendezvous, most likely)" in port["detail"]
    assert "the same release files (" in checks[None]["nodes agree"]["detail"]

    done = dflashctl(two, "stop", "--json")
    assert done.returncode == 0, done.stderr
    for index, node in enumerate(flat(json.loads(done.stdout))["nodes"]):
        # The run's process group (torchrun), and its rank: torchrun starts each rank in
        # a session of its own, so the agent finds it as a process of the same run.
        assert {s["run_id"] for s in node["stopped"]} == {run_id}
        assert [s["kind"] for s in node["stopped"]][0] == "active"
        assert not pid_alive(two.pid(index, run_id))
        # torchrun passed the SIGTERM on to its rank, which wrote its checkpoint.
        assert (two.run_dir(index, run_id) / "checkpointed").read_text() == "yes\n"
    runs = flat(json.loads(dflashctl(two, "runs", "--json").stdout))["nodes"]
    assert [n["runs"][0]["status"] for n in runs] == ["stopped", "stopped"]


def test_one_node_whose_python_fails_answers_as_a_command_that_failed(tmp_path, monkeypatch):
    """No node answered: the error as that node said it (no node named), and --json's
    error answer with the node's entry."""
    for project in make_project(tmp_path, monkeypatch, NAMES[:1]):
        config = yaml.safe_load(project.config_path.read_text())
        config["nodes"][0]["container"]["python"] = "/opt/nowhere/python3"
        project.config_path.write_text(yaml.safe_dump(config))
        for command in (("runs",), ("stop",), ("stacks",)):
            done = dflashctl(project, *command, "--json")
            assert done.returncode == 3, (command, done.stderr)
            answer = json.loads(done.stdout)
            [entry] = answer["nodes"]  # the node, and what failed there
            assert entry["node"] == "gpu-a" and answer["exit_code"] == 3
            assert entry["error"]["message"] == answer["error"]
            assert answer["error"].startswith("/opt/nowhere/python3"), answer
            assert "error: /opt/nowhere/python3" in done.stderr
        # status still has the node's container to say, and its runs' error beside it.
        done = dflashctl(project, "status", "--json")
        assert done.returncode == 3
        [entry] = json.loads(done.stdout)["nodes"]
        assert entry["error"] is None
        assert entry["active_run_error"]["message"].startswith("/opt/nowhere/python3")
