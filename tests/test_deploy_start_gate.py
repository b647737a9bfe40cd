"""deploy --detach says a run started only once every node's log showed its start line
(every rank past the rendezvous), and names the crash when the run died before that:
two nodes on this machine (one torchrun job, tests/test_deploy_nodes.py's project) and
one node, with the fake trainer and with the bundled one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.json_answers import flat
from tests.test_deploy_nodes import DFLASHCTL, TwoNodes
from tests.test_deploy_support import kill_runs, write_local_config, write_trainer

pytestmark = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("torch"), reason="torchrun comes with torch"
)

GREETING = "^hello from the trainer"  # the fake trainer's first line, once it runs


def set_run(config_path: Path, **run) -> None:
    config = yaml.safe_load(config_path.read_text())
    config.setdefault("run", {}).update(run)
    config_path.write_text(yaml.safe_dump(config))


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    project = TwoNodes(tmp_path / "project")
    set_run(project.config_path, start_line=GREETING)
    yield project
    for name in ("a", "b"):
        kill_runs(project.workdir(name))


def detached(config: Path, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASHCTL, "deploy", "--detach", "-c", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_a_healthy_two_node_deploy_says_started_once_both_nodes_showed_the_line(nodes):
    done = detached(nodes.config_path, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = flat(json.loads(done.stdout))
    assert summary["start"]["status"] == "started"
    assert summary["start"]["waiting_for"] == []
    assert "started on all 2 nodes" in done.stderr
    for name in ("a", "b"):
        log = (nodes.run_dir(name, summary["run_id"]) / "train.log").read_text()
        assert "hello from the trainer" in log  # both ranks ran when it said so


@pytest.fixture
def port_holder(nodes):
    """A process that holds torchrun.port on node a and passes the port check before the
    stop as a leftover of this workdir's runs (its DFLASH_RUN_DIR) that the stop does
    not end (not the entry script): the way the new run's ranks die at the rendezvous."""
    port = yaml.safe_load(nodes.config_path.read_text())["torchrun"]["port"]
    leftover = nodes.workdir("a") / "runs" / "20200101-000000-0000"
    leftover.mkdir(parents=True)
    env = dict(os.environ, DFLASH_RUN_DIR=str(leftover))
    program = (
        "import socket, sys, time\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('127.0.0.1', {port})); s.listen(64); print('ready', flush=True)\n"
        "while True:\n"
        "    c, _ = s.accept(); c.close()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", program], env=env, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "ready"
    yield port
    holder.send_signal(signal.SIGKILL)
    holder.wait()


def test_ranks_that_die_at_the_rendezvous_fail_the_detached_deploy_naming_it(nodes, port_holder):
    done = detached(nodes.config_path)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "started" not in said.replace("starts at step 0", "")
    assert "port_in_use" in said  # the crash detector's category, in its panel
    assert "crashed; root cause (the first failure in time): node a" in said
    assert "Address already in use" in said or "EADDRINUSE" in said


def test_the_json_of_a_failed_start_has_the_result_as_following_would(nodes, port_holder):
    done = detached(nodes.config_path, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    summary = flat(json.loads(done.stdout))
    assert summary["start"]["status"] == "died"
    assert summary["start"]["waiting_for"] == ["a", "b"]
    assert summary["result"]["status"] == "crashed"
    assert summary["result"]["root_cause"]["node"] == "a"
    assert summary["result"]["root_cause"]["category"] == "port_in_use"


def test_a_start_line_that_never_comes_times_out_with_a_warning_and_exit_0(nodes):
    set_run(nodes.config_path, start_line="^never printed", start_timeout_s=3)
    done = detached(nodes.config_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "still running but has not shown its start line on a, b after 3 s" in done.stderr
    assert "run.start_timeout_s" in done.stderr


# --------------------------------------------------------------------------- one node


@pytest.fixture
def one_node(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "project"
    write_trainer(root / "src")
    yield root
    kill_runs(root / "workdir")


def test_one_node_waits_for_its_line_and_reports_a_death_before_it(one_node):
    config = write_local_config(one_node, args=["--sleep", "60", "--on-term", "checkpoint"])
    set_run(config, start_line=GREETING)
    done = detached(config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "started: its start line came" in done.stderr

    write_local_config(one_node, args=["--exit", "3"])
    set_run(config, start_line="^never printed")
    died = detached(config)
    assert died.returncode == 1, died.stdout + died.stderr
    assert "crashed: exit status 3" in died.stderr
    assert "started:" not in died.stderr


def test_a_trainer_that_names_no_start_line_is_not_waited_for(one_node):
    config = write_local_config(one_node)
    done = detached(config, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "start" not in flat(json.loads(done.stdout))
    assert "started" not in done.stderr.replace("starts at step 0", "")


BUNDLED = Path(__file__).resolve().parent.parent / "trainer"


def test_the_bundled_trainer_is_waited_for_until_its_rendezvous_line(one_node, tmp_path):
    """Its entry script names DFLASH_START_GATE: no run.start_line needed."""
    config = {
        "host": {"address": "local"},
        "container": {"vmid": None, "workdir": str(one_node / "workdir"), "python": sys.executable},
        "trainer": {
            "source": str(BUNDLED),
            "entry": "train_dflash_pipeline.py",
            "args": ["--config", "configs/tiny-cpu.yaml", "--set", "train.steps=100000"],
        },
        "run": {"stop_grace_s": 5},
    }
    path = one_node / "bundled.yaml"
    path.write_text(yaml.safe_dump(config))
    done = detached(path, "--json", "--yes", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = flat(json.loads(done.stdout))
    assert summary["start"]["status"] == "started"
    log = (one_node / "workdir" / "runs" / summary["run_id"] / "train.log").read_text()
    assert "rendezvous: none needed (one process)" in log


def test_a_start_line_that_is_no_regex_is_a_config_error_before_anything_runs(one_node):
    config = write_local_config(one_node)
    set_run(config, start_line="rendezvous: (")
    done = detached(config)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "run.start_line: not a regular expression" in done.stderr
    assert not (one_node / "workdir").exists()
    set_run(config, start_line="^ok", start_timeout_s=-1)
    done = detached(config)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "run.start_timeout_s: must be 0 (no wait) or more seconds, got -1" in done.stderr
