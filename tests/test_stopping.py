"""What stopping says (dflashctl/ops/stop.py): how a stopped process ended, and a run
that outlived SIGKILL, named by its node when there are several."""

from __future__ import annotations

import pytest

from dflashctl.ops.stop import NodeStop, describe_stopped, stuck_error
from dflashctl.remote.nodes import NodeOutcome
from tests.test_node_errors import FakeNode, FakeTarget


def test_how_a_stopped_process_ended():
    assert describe_stopped(
        {"run_id": "r1", "pid": 7, "ended": "terminated", "seconds": 1.26, "exit_code": 0}
    ) == ("stopped run r1 (pid 7): exited after SIGTERM in 1.3 s, exit code 0")
    assert describe_stopped({"pid": 9, "ended": "killed", "seconds": 5}) == (
        "stopped hand-started process (pid 9): killed with SIGKILL after the 5 s grace period"
    )


def results(*all_stopped: bool | None) -> list[NodeStop]:
    made = []
    for index, done in enumerate(all_stopped):
        name = f"gpu-{index}"
        node = FakeNode(name, FakeTarget("this machine"))
        if done is None:
            outcome = NodeOutcome(node, error=OSError("down"))
        else:
            outcome = NodeOutcome(node, value={"stopped": [], "all_stopped": done})
        made.append(NodeStop(name, "this machine", outcome))
    return made


@pytest.mark.parametrize("count", [1, 2])
def test_a_run_that_outlived_sigkill(count):
    assert stuck_error(results(*[True] * count)) is None
    error = stuck_error(results(*[False] * count))
    assert error is not None and error.exit_code == 3
    where = "" if count == 1 else " on gpu-0, gpu-1"
    assert error.message == f"a run did not exit even after SIGKILL{where}"
    assert results(None)[0].stopped == [] and not results(None)[0].stuck
