"""A step's failure on the nodes as data (dflashctl/remote/nodes.py): one error type,
NodesFailed, for one node and for several, carrying every node's outcome; of one node
it says that node's own error, of several the first named with its node."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dflashctl.errors import ConfigError, HostError
from dflashctl.remote.nodes import (
    NodeOutcome,
    NodesFailed,
    error_json,
    error_text,
    fleet_failure,
    nobody_answered,
    values_or_raise,
)


@dataclass
class FakeTarget:
    place: str

    def describe(self) -> str:
        return self.place


@dataclass
class FakeNode:
    name: str
    target: FakeTarget


def outcomes(*errors: BaseException | None) -> list[NodeOutcome]:
    names = ["gpu-a", "gpu-b", "gpu-c"][: len(errors)]
    return [
        NodeOutcome(FakeNode(n, FakeTarget(f"CT {i} on root@{n}")), value=None if e else 1, error=e)
        for i, (n, e) in enumerate(zip(names, errors, strict=True))
    ]


def test_nothing_failed():
    assert fleet_failure(outcomes(None)) is None
    assert fleet_failure(outcomes(None, None)) is None
    assert not nobody_answered(outcomes(None, HostError("down")))


def test_one_node_says_its_own_error_and_carries_its_outcome():
    error = HostError("ssh: connection refused", hint="check the host")
    failure = fleet_failure(outcomes(error), "stopping runs")
    assert isinstance(failure, NodesFailed) and failure.cause is error
    assert (failure.message, failure.hint, failure.exit_code) == (error.message, error.hint, 3)
    assert failure.nodes_json() == [
        {"node": "gpu-a", "error": {"message": error.message, "hint": "check the host"}}
    ]
    assert nobody_answered(outcomes(error))
    with pytest.raises(NodesFailed) as raised:
        values_or_raise(outcomes(error), "stopping runs")
    assert raised.value.message == error.message


@pytest.mark.parametrize("failed", [(1,), (0, 2)])
def test_several_nodes_name_the_first_that_failed_and_keep_its_error(failed):
    errors = [ConfigError(f"bad on {i}", hint="fix it") if i in failed else None for i in range(3)]
    failure = fleet_failure(outcomes(*errors), "listing runs")
    assert isinstance(failure, NodesFailed)
    first = failed[0]
    name = ["gpu-a", "gpu-b", "gpu-c"][first]
    assert failure.node == name and failure.step == "listing runs"
    assert failure.cause is errors[first] and errors[first].message == f"bad on {first}"
    assert failure.errors() == dict(zip(["gpu-a", "gpu-b", "gpu-c"], errors, strict=True))
    assert [n["node"] for n in failure.nodes_json()] == ["gpu-a", "gpu-b", "gpu-c"]
    assert failure.exit_code == ConfigError.exit_code and failure.hint == "fix it"
    also = " (also failed: gpu-c)" if len(failed) > 1 else ""
    assert failure.message == (
        f"node {name} (CT {first} on root@{name}) listing runs: bad on {first}{also}"
    )


def test_a_bug_keeps_its_own_exception():
    bug = KeyError("x")
    assert fleet_failure(outcomes(None, bug)) is bug


def test_the_error_as_json_and_as_text():
    assert error_json(None) is None
    assert error_json(HostError("down", hint="retry")) == {"message": "down", "hint": "retry"}
    assert error_json(OSError()) == {"message": "OSError", "hint": None}
    assert error_text(HostError("down")) == "down"
    assert error_text(ValueError("odd")) == "odd"
