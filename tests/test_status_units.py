"""What `status` reads of one node (ops/status.py) and which live runs hold which GPUs
(container/holders.py), on this machine through the local transport: the real agent
answers for a workdir made here, and the /proc probe finds a process started here with
a run's environment. Through the test host they are tests/test_status.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflashctl.container import holders
from dflashctl.errors import HostError
from dflashctl.ops.status import node_status
from dflashctl.remote.deploy_target import Target
from dflashctl.remote.transport.local import LocalTransport

RUN = "20261205-080000-0001"


def here() -> Target:
    return Target(LocalTransport(), None)


def config(workdir: Path, python: str = sys.executable) -> SimpleNamespace:
    return SimpleNamespace(
        container=SimpleNamespace(workdir=str(workdir), python=python),
        proxmox=SimpleNamespace(node="pve"),
    )


def test_status_names_the_release_current_points_at_and_the_active_runs_end(tmp_path):
    (tmp_path / "releases" / "r1").mkdir(parents=True)
    (tmp_path / "current").symlink_to("releases/r1")
    run = tmp_path / "runs" / RUN
    run.mkdir(parents=True)
    (run / "meta.json").write_text('{"release": "r1"}')
    (run / "exit_code").write_text("3\n")
    (tmp_path / "active_run").write_text(RUN + "\n")
    status = node_status(config(tmp_path), None, here())
    assert status["release"] == "r1" and status["workdir"] == str(tmp_path)
    assert status["container"] is None and status["node"] is None  # no Proxmox: the host
    assert status["active_run"]["id"] == RUN
    assert status["active_run"]["exit_code"] == 3
    assert status["active_run"]["status"] == "exited"
    assert status["active_run_error"] is None


def test_status_of_an_empty_workdir_says_nothing_runs(tmp_path):
    status = node_status(config(tmp_path / "new"), None, here())
    assert (status["release"], status["active_run"], status["active_run_error"]) == (
        None,
        None,
        None,
    )


def test_status_shows_why_the_run_could_not_be_read_and_what_to_do(tmp_path):
    status = node_status(config(tmp_path, python="/nonexistent/python3"), None, here())
    assert status["active_run"] is None
    error = status["active_run_error"]
    assert "/nonexistent/python3" in error["message"] and "container.python" in error["hint"]


@pytest.fixture
def holder(tmp_path):
    """A process here with a run's environment, holding GPUs 1 and 3."""
    run_dir = str(tmp_path / "other" / "runs" / RUN)
    env = dict(os.environ, DFLASH_RUN_ID=RUN, DFLASH_RUN_DIR=run_dir, CUDA_VISIBLE_DEVICES="1,3")
    proc = subprocess.Popen(["sleep", "60"], env=env)
    yield run_dir
    proc.kill()
    proc.wait()


def test_a_live_run_anywhere_on_the_machine_is_found_with_its_gpus(holder):
    # Other runs may live on this machine too: only ours is looked at.
    found = [h for h in holders.live_holders(here()) if h.run_dir == holder]
    assert found == [holders.Holder(RUN, (1, 3), holder)]
    assert found[0].describe_gpus() == "GPU 1,3"


class Probed:
    """A container whose /proc probe answers `lines`."""

    def __init__(self, lines: str) -> None:
        self.lines = lines

    def run(self, argv, check=True):
        assert argv[:2] == ["sh", "-c"] and "/proc/" in argv[2]
        return SimpleNamespace(stdout_text=self.lines)

    def describe(self) -> str:
        return "CT 200 on root@gpu-a"


def test_a_deploy_is_refused_where_another_workdirs_run_holds_its_gpus():
    target = Probed(f"{RUN}|1,3|/other/runs/{RUN}\nMINE|*|/mine/runs/MINE\n")
    with pytest.raises(HostError) as info:
        holders.refuse_if_held(target, "/mine", [0, 3])
    assert str(info.value) == (
        f"GPU 3 of CT 200 on root@gpu-a is held by run {RUN} (workdir /other, GPU 1,3): "
        "nothing was stopped"
    )
    assert "run.gpus" in info.value.hint
    holders.refuse_if_held(target, "/mine", [0, 2])  # none in common
    with pytest.raises(HostError, match="GPU 1,3 of"):
        holders.refuse_if_held(target, "/mine", None)  # every GPU: 1 and 3 too
    holders.refuse_if_held(Probed("MINE|*|/mine/runs/MINE\n"), "/mine/", None)  # its own


def test_the_probe_lines_are_read_as_runs_and_gpus():
    text = f"{RUN}|*|/w/runs/{RUN}\n{RUN}|*|/w/runs/{RUN}\nbad line\n|0|/x\nB|0,2|/v/runs/B\n"
    found = holders.parse(text)
    assert [(h.run_id, h.gpus) for h in found] == [(RUN, None), ("B", (0, 2))]
    every = found[0]
    assert every.describe_gpus() == "every GPU"
    assert every.overlaps([5]) == [5] and every.overlaps(None) is None
    assert found[1].overlaps(None) == [0, 2] and found[1].overlaps([1]) is None
