"""deploy and restart across several nodes, on two local workdirs (one per node): the
release built on every node before any launch, one torchrun job with one run id, and
all or nothing when a node fails.

The containers-on-two-hosts version of this, with the bundled trainer, is
tests/test_nodes_container.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.json_answers import flat
from tests.test_deploy_support import (
    kill_runs,
    pid_alive,
    release_manifest,
    wait_for,
    write_trainer,
)

DFLASHCTL = [sys.executable, "-m", "dflashctl"]

pytestmark = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("torch"), reason="torchrun comes with torch"
)


def job_ports() -> dict[str, int]:
    """torchrun's port and the commit store's, both the kernel's pick (the commit port's
    default, port + 1, is now and then another test's connection)."""
    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", 0))
        second.bind(("127.0.0.1", 0))
        return {"port": first.getsockname()[1], "commit_port": second.getsockname()[1]}


class TwoNodes:
    """A project whose dflash.yaml names two nodes on this machine: workdirs a/ and b/."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.source = write_trainer(root / "src")
        self.python = {"a": sys.executable, "b": sys.executable}
        self.args = ["--steps", "3", "--sleep", "60", "--on-term", "checkpoint"]
        self.run = {"stop_grace_s": 5}
        self.write()

    def write(self) -> None:
        config = {
            "host": {"address": "local"},
            "container": {"vmid": None, "python": sys.executable},
            "trainer": {"source": "src", "entry": "train.py", "args": self.args},
            "run": self.run,
            "torchrun": {"nproc_per_node": 1, "address": "127.0.0.1", **job_ports()},
            "nodes": [
                {"name": name, "container": {"workdir": str(self.workdir(name)), "python": py}}
                for name, py in self.python.items()
            ],
        }
        self.config_path = self.root / "dflash.yaml"
        self.config_path.write_text(yaml.safe_dump(config))

    def workdir(self, name: str) -> Path:
        return self.root / name

    def cli(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*DFLASHCTL, *args, "-c", str(self.config_path)],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def run_dir(self, name: str, run_id: str) -> Path:
        return self.workdir(name) / "runs" / run_id

    def meta(self, name: str, run_id: str) -> dict:
        return json.loads((self.run_dir(name, run_id) / "meta.json").read_text())

    def pid(self, name: str, run_id: str) -> int:
        return int((self.run_dir(name, run_id) / "pid").read_text())

    def releases(self, name: str) -> list[str]:
        folder = self.workdir(name) / "releases"
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    project = TwoNodes(tmp_path / "project")
    yield project
    for name in ("a", "b"):
        kill_runs(project.workdir(name))


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def deployed(project: TwoNodes, *extra: str) -> dict:
    result = project.cli("deploy", "--detach", "--json", *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    return flat(json.loads(result.stdout))


def test_deploy_launches_one_torchrun_job_on_every_node(nodes):
    summary = deployed(nodes)
    run_id, release = summary["run_id"], summary["release"]
    assert [n["node"] for n in summary["nodes"]] == ["a", "b"]
    assert summary["rendezvous"].startswith("127.0.0.1:")
    for rank, name in enumerate(("a", "b")):
        assert nodes.releases(name) == [release]
        assert (nodes.workdir(name) / "current").resolve().name == release
        meta = nodes.meta(name, run_id)
        assert meta["node"] == {
            "name": name,
            "rank": rank,
            "count": 2,
            "names": ["a", "b"],
            "rendezvous": summary["rendezvous"],
        }
        command = meta["command"]
        assert command[1:3] == ["-m", "torch.distributed.run"]
        assert f"--node-rank={rank}" in command and "--nnodes=2" in command
        assert f"--rdzv-id={run_id}" in command and command[-6:] == nodes.args
        env = environ(nodes.pid(name, run_id))
        assert (env["DFLASH_NODE_NAME"], env["DFLASH_NODE_RANK"]) == (name, str(rank))
        assert env["DFLASH_NUM_NODES"] == "2" and env["DFLASH_RUN_ID"] == run_id
        assert env["GLOO_SOCKET_IFNAME"] == "lo"  # the way to 127.0.0.1
    # The job really runs as one: both nodes' trainers get past the rendezvous.
    for name in ("a", "b"):
        log = nodes.run_dir(name, run_id) / "train.log"
        wait_for(
            lambda log=log: "training complete" in log.read_text(),
            timeout=60,
            what=f"node {name}'s trainer",
        )


def test_a_redeploy_replaces_the_run_on_every_node_and_sends_only_changes(nodes):
    first = deployed(nodes)
    (nodes.source / "helpers.py").write_text("def greeting():\n    return 'changed'\n")
    second = deployed(nodes)
    assert second["release"] != first["release"]
    for entry in second["nodes"]:
        assert entry["files_sent"] == 1 and entry["previous_release"] == first["release"]
        # The old run, and maybe its rank outside torchrun's group ("member").
        stopped = entry["runs_stopped"]
        assert {s["run_id"] for s in stopped} == {first["run_id"]}
        assert [s["kind"] for s in stopped if s["kind"] != "member"] == ["active"]
    for name in ("a", "b"):
        assert not pid_alive(nodes.pid(name, first["run_id"]))
        assert nodes.meta(name, second["run_id"])["release"] == second["release"]


def test_a_node_that_fails_to_build_stops_nothing_anywhere(nodes, tmp_path):
    first = deployed(nodes)
    # Node b's interpreter refuses the deploy step only (`python -S -c <loader> deploy`:
    # the verb is its 4th argument): node a builds its release and waits at the commit
    # barrier, and aborts when told, before anything is stopped.
    wrapper = tmp_path / "python-b"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$4" = deploy ]; then echo "No space left on device" >&2; exit 1; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    nodes.python["b"] = str(wrapper)
    nodes.write()
    (nodes.source / "helpers.py").write_text("def greeting():\n    return 'changed'\n")
    result = nodes.cli("deploy", "--detach")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "launched nowhere: node b (this machine) failed" in result.stderr
    assert "a: aborted: nothing stopped" in result.stderr
    assert "Traceback" not in result.stderr
    for name in ("a", "b"):
        # The old run still runs, from the old release, which is still current.
        assert pid_alive(nodes.pid(name, first["run_id"]))
        assert (nodes.workdir(name) / "current").resolve().name == first["release"]
        # The release node a built was removed again.
        assert nodes.releases(name) == [first["release"]]
        assert sorted(p.name for p in (nodes.workdir(name) / "runs").iterdir()) == [first["run_id"]]


def test_restart_relaunches_the_same_release_everywhere(nodes):
    first = deployed(nodes)
    result = nodes.cli("restart", "--detach", "--json")
    assert result.returncode == 0, result.stderr
    summary = flat(json.loads(result.stdout))
    assert summary["release"] == first["release"] and summary["run_id"] != first["run_id"]
    for name in ("a", "b"):
        assert nodes.meta(name, summary["run_id"])["node"]["name"] == name
        assert not pid_alive(nodes.pid(name, first["run_id"]))


def test_restart_refuses_nodes_with_different_releases(nodes):
    deployed(nodes)
    (nodes.workdir("b") / "current").unlink()
    result = nodes.cli("restart", "--detach")
    assert result.returncode == 3, result.stderr
    assert "launched nowhere: node b (this machine) failed: nothing is deployed" in result.stderr
    assert "a: aborted: nothing stopped" in result.stderr


def test_dry_run_shows_every_node_and_changes_nothing(nodes):
    result = nodes.cli("deploy", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "node a (this machine) (node rank 0)" in result.stdout
    assert "--node-rank=1" in result.stdout
    assert not nodes.workdir("a").exists() or not (nodes.workdir("a") / "releases").exists()


def test_no_network_address_is_a_clear_error_naming_the_first_node(nodes):
    config = yaml.safe_load(nodes.config_path.read_text())
    del config["torchrun"]["address"]
    nodes.config_path.write_text(yaml.safe_dump(config))
    # In a network namespace of its own with only loopback, node a has no address.
    unshare = ["unshare", "--net", "--map-root-user"] if os.geteuid() else ["unshare", "--net"]
    probe = subprocess.run([*unshare, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.decode().strip()}")
    result = subprocess.run(
        [*unshare, *DFLASHCTL, "deploy", "--detach", "-c", str(nodes.config_path)],
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "node a (this machine) has no network address but loopback" in result.stderr
    assert "torchrun.address" in result.stderr


def settled(workdir: Path, timeout: float = 300) -> None:
    """Wait until no deploy holds the workdir's lock (the agent's work there is done)."""
    import fcntl
    import time

    deadline = time.monotonic() + timeout
    fd = os.open(workdir / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except OSError:
                assert time.monotonic() < deadline, f"{workdir} stayed locked"
                time.sleep(0.2)
    finally:
        os.close(fd)


def test_a_sigkilled_deploy_leaves_every_node_on_the_same_run(nodes, tmp_path):
    nodes.args = ["--steps", "3", "--sleep", "900", "--on-term", "checkpoint"]
    nodes.write()  # the old run outlives the test: its end is ours to see
    first = deployed(nodes)
    # Node b's deploy starts late: node a waits at the commit barrier meanwhile, and
    # dflashctl is killed then. Whatever the moment, the nodes agree.
    wrapper = tmp_path / "python-b"
    wrapper.write_text(
        f'#!/bin/sh\nif [ "$4" = deploy ]; then sleep 3; fi\nexec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    nodes.python["b"] = str(wrapper)
    # A node left alone at the barrier aborts at its deadline: a short one, so the test
    # does not wait out the default 120 s (the outcome must agree all the same).
    nodes.run["commit_timeout_s"] = 15
    nodes.write()
    (nodes.source / "helpers.py").write_text("def greeting():\n    return 'changed'\n")
    proc = subprocess.Popen(
        [*DFLASHCTL, "deploy", "--detach", "-c", str(nodes.config_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    wait_for(
        lambda: any((nodes.workdir("a") / "releases").glob("*")) and len(nodes.releases("a")) > 1,
        timeout=120,
        what="node a's new release",
    )
    proc.kill()
    proc.wait()
    for name in ("a", "b"):
        settled(nodes.workdir(name))
    currents = {(nodes.workdir(n) / "current").resolve().name for n in ("a", "b")}
    assert len(currents) == 1, currents
    old_alive = [pid_alive(nodes.pid(n, first["run_id"])) for n in ("a", "b")]
    if currents == {first["release"]}:
        assert old_alive == [True, True]
    else:
        assert old_alive == [False, False]


def test_a_deploy_from_elsewhere_in_between_is_noticed_on_every_node(nodes, monkeypatch, tmp_path):
    """Our plan comes from what we deployed last; a colleague's deploy in between makes
    every node answer `stale`: both are inspected and deployed again, as one run."""
    mine = deployed(nodes)
    # A colleague deploys another version from their machine (their own cache)...
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "colleague-cache"))
    ours = (nodes.source / "helpers.py").read_bytes()
    (nodes.source / "helpers.py").write_text("def greeting():\n    return 'colleague'\n")
    theirs = deployed(nodes)
    # ...and we deploy our version again, planned from our cache: out of date everywhere.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (nodes.source / "helpers.py").write_bytes(ours)
    again = deployed(nodes)
    run_id, release = again["run_id"], again["release"]
    assert release not in (mine["release"], theirs["release"])
    assert run_id not in (mine["run_id"], theirs["run_id"])
    for name, entry in zip(("a", "b"), again["nodes"], strict=True):
        assert entry["node"] == name and entry["error"] is None
        assert entry["release"] == release and entry["previous_release"] == theirs["release"]
        assert entry["files_sent"] == 1
        assert {s["run_id"] for s in entry["runs_stopped"]} == {theirs["run_id"]}
        current = (nodes.workdir(name) / "current").resolve()
        assert current.name == release
        assert (current / "helpers.py").read_bytes() == ours
        assert not list((nodes.workdir(name) / "releases").glob("*.partial"))
        assert nodes.meta(name, run_id)["release"] == release
        assert pid_alive(nodes.pid(name, run_id))
        assert not pid_alive(nodes.pid(name, theirs["run_id"]))
        assert not pid_alive(nodes.pid(name, mine["run_id"]))


def test_a_node_whose_release_changed_under_us_is_inspected_and_repaired(nodes):
    """A file edited in place in node b's current release fails the check of what we
    remember there (`stale`, node a aborts): b alone is inspected and gets the file
    again, and both nodes launch one run of the same content."""
    first = deployed(nodes)
    (nodes.source / "helpers.py").write_text("def greeting():\n    return 'second'\n")
    second = deployed(nodes)  # planned from what we remember: no inspect
    tampered = nodes.workdir("b") / "current" / "configs" / "tiny.yaml"
    tampered.write_text("steps: 999999\n")
    (nodes.source / "helpers.py").write_text("def greeting():\n    return 'third'\n")
    third = deployed(nodes)
    run_id, release = third["run_id"], third["release"]
    assert release not in (first["release"], second["release"])
    sent = {e["node"]: e["files_sent"] for e in third["nodes"]}
    assert sent == {"a": 1, "b": 2}  # helpers.py everywhere, tiny.yaml again on b
    for entry in third["nodes"]:
        assert entry["error"] is None and entry["release"] == release
        assert entry["previous_release"] == second["release"]
        assert {s["run_id"] for s in entry["runs_stopped"]} == {second["run_id"]}
    currents = [(nodes.workdir(n) / "current").resolve() for n in ("a", "b")]
    assert [c.name for c in currents] == [release, release]
    # What was deployed, the same on both (the run's own __pycache__ aside).
    files = release_manifest(currents[0])
    assert release_manifest(currents[1]) == files
    for rel in files:
        source = (nodes.source / rel).read_bytes()
        assert [(c / rel).read_bytes() for c in currents] == [source, source], rel
    assert tampered.read_bytes() == (nodes.source / "configs" / "tiny.yaml").read_bytes()
    for name in ("a", "b"):
        assert nodes.meta(name, run_id)["release"] == release
        assert pid_alive(nodes.pid(name, run_id))
        assert not pid_alive(nodes.pid(name, second["run_id"]))
        # Nothing of the refused attempt: no partial release, no run folder of its own.
        assert not list((nodes.workdir(name) / "releases").glob("*.partial"))
        assert release in nodes.releases(name)
        runs_made = sorted(p.name for p in (nodes.workdir(name) / "runs").iterdir())
        assert runs_made == sorted([first["run_id"], second["run_id"], run_id])
