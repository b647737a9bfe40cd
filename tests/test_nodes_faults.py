"""Issue 25's faults on a 2-node deploy, on two real containers behind two test hosts:
after each, every node runs the new run or every node still runs the old one (never a
mix), `current` is one complete release everywhere, the error names the node, and the
next plain deploy repairs it (tests/fault_support.py says how the moments are aimed).

One pair of containers serves the module; each test starts from one run on both nodes
and leaves one run on both nodes (its repair deploy's).
"""

from __future__ import annotations

import pytest

from tests import fault_support as fs
from tests import full_disk

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(pve_host, pve_host2, shared_known_hosts, tmp_path_factory):
    made = fs.make_pair(
        tmp_path_factory.mktemp("faults"),
        pve_host,
        pve_host2,
        shared_known_hosts,
        small_disk_on_b=True,
    )
    yield made
    fs.close_pair(made)


@pytest.fixture
def old_run(pair):
    run_id = fs.old_runs_everywhere(pair)
    yield run_id
    for node in pair.nodes:  # whatever a test left: hosts up, disks with room
        if not node.host.is_up:
            node.host.restart()
        fs.free_workdir(node)


def said(trial) -> str:
    return trial.out + trial.err


def assert_good_then_repaired(pair, trial, outcome):
    assert outcome.good, (
        f"{outcome.detail}\nCLI said:\n{said(trial)[-3000:]}\n{fs.new_runs_left(trial)}"
    )
    fs.deploy_ok(pair)


@pytest.mark.parametrize(
    "moment", ["built on both, before any launch", "launch began on gpu-a", "launched on gpu-a"]
)
def test_sigkill_of_the_cli_at_an_aimed_moment(pair, old_run, moment):
    trial, _code, outcome = fs.strike(pair, fs.moments(pair)[moment], fs.Trial.sigkill)
    assert trial.hit, f"the deploy ended before {moment!r}:\n{said(trial)}"
    assert_good_then_repaired(pair, trial, outcome)


def test_ctrl_c_during_the_launch_exits_130_and_says_what_each_node_left(pair, old_run):
    trial, code, outcome = fs.strike(
        pair, fs.moments(pair)["launch began on gpu-a"], fs.Trial.ctrl_c
    )
    assert trial.hit, said(trial)
    assert code == 130, said(trial)
    assert "Traceback" not in trial.err, trial.err
    assert "gpu-a" in trial.err and "gpu-b" in trial.err, trial.err
    assert_good_then_repaired(pair, trial, outcome)


@pytest.mark.parametrize("moment", ["building on gpu-b", "launch began on gpu-a"])
def test_sshd_of_node_b_dies_during_the_deploy(pair, old_run, moment):
    trial, code, outcome = fs.strike(pair, fs.moments(pair)[moment], lambda t: pair.b.host.crash())
    assert trial.hit, said(trial)
    pair.b.host.restart()  # the host is back: what the deploy left is read, then repaired
    if not (outcome.good and outcome.which == "new"):
        assert code != 0, said(trial)
        assert "gpu-b" in said(trial), said(trial)
    assert_good_then_repaired(pair, trial, outcome)


def test_a_node_that_cannot_be_reached_changes_nothing_anywhere(pair, old_run):
    pair.b.host.crash()
    trial, code, outcome = fs.strike(pair, None, lambda t: None)
    assert code != 0, said(trial)
    assert "gpu-b" in said(trial), said(trial)
    pair.b.host.restart()
    assert outcome.good and outcome.which == "old", outcome.detail
    fs.deploy_ok(pair)


def test_a_full_disk_on_node_b_refuses_the_deploy_and_stop_still_stops(pair, old_run):
    # The old run said its line first: a rank still starting would die of the full
    # disk by itself (its first print fails), which is not the deploy's doing.
    fs.wait_until(lambda: fs.joined(pair, old_run), 180, "the old run's ranks to join")
    fs.fill_workdir(pair.b)
    assert full_disk.is_full(pair.b.view)
    trial, code, outcome = fs.strike(pair, None, lambda t: None)
    assert code != 0, said(trial)
    assert "gpu-b" in said(trial), said(trial)
    assert outcome.good and outcome.which == "old", outcome.detail  # nothing stopped anywhere

    stopped = pair.cli("stop", timeout=180)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not any(node.state().running for node in pair.nodes), [
        s.describe() for s in pair.states()
    ]

    fs.free_workdir(pair.b)
    fs.deploy_ok(pair)


def test_no_node_launches_before_every_node_stopped_its_old_run(pair, old_run, tmp_path):
    """Node 0's old torchrun hosts the job's store on torchrun.port until its rank has
    stopped (the trainer writes a checkpoint on SIGTERM: seconds, minutes for a big
    drafter). A new rank on another node that starts meanwhile joins that old store,
    and dies with it: the nodes would run a mix. Every node stops its old run before
    any node launches the new one."""
    import yaml

    config = yaml.safe_load(pair.config.read_text())
    config["run"]["stop_grace_s"] = 60
    slow = tmp_path / "dflash.yaml"
    slow.write_text(yaml.safe_dump(config))
    default, pair.config = pair.config, slow
    try:
        (pair.source / "slow_stop_rank0").write_text("15")
        pair.new_source()
        fs.deploy_ok(pair)  # the run to replace: its rank 0 takes 15 s to stop
        (pair.source / "slow_stop_rank0").unlink()
        pair.new_source()
        run_id = fs.deploy_ok(pair)
        fs.wait_until(lambda: fs.joined(pair, run_id), 120, f"both ranks of {run_id} joined")
        states = fs.settle(pair)
        assert all(s.running == {run_id} for s in states), [s.describe() for s in states]
    finally:
        (pair.source / "slow_stop_rank0").unlink(missing_ok=True)  # the next tests stop fast
        pair.config = default
