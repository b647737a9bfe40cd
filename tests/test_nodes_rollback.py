"""A launch that fails on one node after every node stopped its old run (the launch
round, dflashctl/agent/commit.py): the new run is taken down on every node and the
previous release launched again everywhere, so no node runs the new run alone.

On two local workdirs (tests/test_deploy_nodes.py's project). Node b's interpreter for
the new run is taken away while node b waits at the stop gate for node a, whose old
run takes 6 s to stop: node b cannot start the new run, node a can. (The test takes
node b's interpreter away the moment node b's old run has stopped: 6 s are room enough.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_deploy_nodes import DFLASHCTL, deployed, nodes  # noqa: F401 - the fixture
from tests.test_deploy_support import pid_alive, wait_for

pytestmark = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("torch"), reason="torchrun comes with torch"
)


def interpreter(path: Path) -> Path:
    """A python of node b's own, which the test can take away."""
    path.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return path


def slow_stops(project) -> None:
    """Room for the trainer's checkpoint on SIGTERM (6 s on node a) before SIGKILL."""
    config = yaml.safe_load(project.config_path.read_text())
    config["run"]["stop_grace_s"] = 60
    project.config_path.write_text(yaml.safe_dump(config))


def running(project, name: str) -> list[str]:
    runs = project.workdir(name) / "runs"
    return sorted(
        p.name
        for p in runs.iterdir()
        if (p / "pid").exists()
        and not (p / "exit_code").exists()
        and pid_alive(int((p / "pid").read_text()))
    )


def test_a_node_that_cannot_launch_after_the_stop_takes_the_run_down_everywhere(nodes, tmp_path):  # noqa: F811
    nodes.python["b"] = str(interpreter(tmp_path / "python-b-1"))
    nodes.write()
    slow_stops(nodes)
    first = deployed(nodes)
    wait_for(lambda: running(nodes, "a") == [first["run_id"]], what="the first run on node a")
    (nodes.workdir("a") / "slow_stop").write_text("6")
    # The new run's interpreter on node b: there for the build and the barrier, gone by
    # the launch. The previous release's run keeps its own (python-b-1).
    new_python = interpreter(tmp_path / "python-b-2")
    nodes.python["b"] = str(new_python)
    nodes.write()
    slow_stops(nodes)
    (nodes.source / "helpers.py").write_text("def greeting():\n    return 'cannot start'\n")
    deploy = subprocess.Popen(
        [*DFLASHCTL, "deploy", "--detach", "--json", "-c", str(nodes.config_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    old_b = nodes.run_dir("b", first["run_id"])
    wait_for(lambda: (old_b / "exit_code").exists(), timeout=240, what="node b's old run stopped")
    assert pid_alive(nodes.pid("a", first["run_id"]))  # node a is still stopping its own
    new_python.unlink()
    out, err = deploy.communicate(timeout=400)
    assert deploy.returncode == 3, out + err
    assert "Traceback" not in err
    assert "could not start on node b (this machine), so it was taken down on every node" in err
    answer = json.loads(out)
    left = {n["node"]: n["left"] for n in answer["nodes"]}
    assert left == {"a": "old run relaunched", "b": "old run relaunched"}, answer
    # Every node runs the previous release again, as one run, continuing the old one.
    relaunched = [running(nodes, name) for name in ("a", "b")]
    assert relaunched[0] == relaunched[1] and len(relaunched[0]) == 1, relaunched
    (retry,) = relaunched[0]
    assert retry.endswith("-r")
    for name in ("a", "b"):
        assert (nodes.workdir(name) / "current").resolve().name == first["release"]
        assert nodes.meta(name, retry)["relaunched_after"] == retry[: -len("-r")]

    # The next deploy, with node b's interpreter back, runs the new release everywhere.
    (nodes.workdir("a") / "slow_stop").unlink()
    interpreter(new_python)
    again = deployed(nodes)
    assert [running(nodes, name) for name in ("a", "b")] == [[again["run_id"]]] * 2
    assert again["release"] != first["release"]
