"""ops/committing.py without a host: every node's launch call at once, the abort sent to
the others when one fails, and what the error says each node left. The launch calls and
the agent's `abort` are scripted here, as the barrier (ops/launch_command.py) would
answer them; the real barrier across two containers is tests/test_commit_barrier.py's."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from dflashctl.ops import committing
from dflashctl.ops.committing import NEW_RUN, NOTHING, OLD_RELAUNCHED, OLD_RUN
from dflashctl.remote import agent_client
from dflashctl.remote.agent_client import AgentFailed
from dflashctl.remote.nodes import Node, NodesFailed
from dflashctl.reporting import Reporter

RUN = "20261205-080000-0001"


@dataclass
class FakeTarget:
    place: str
    transport: SimpleNamespace = field(init=False)

    def __post_init__(self) -> None:
        self.transport = SimpleNamespace(description=f"root@{self.place}")

    def describe(self) -> str:
        return f"CT 200 on root@{self.place}"


def two_nodes() -> list[Node]:
    return [
        Node(
            i,
            name,
            SimpleNamespace(container=SimpleNamespace(python="py", workdir=f"/w{i}")),
            FakeTarget(name),
        )  # fmt: skip
        for i, name in enumerate(["gpu-a", "gpu-b"])
    ]


class Barrier:
    """The agents' barrier as the launch calls see it: a node waits there until every
    node arrived (commit) or it is told to abort."""

    def __init__(self, nodes: list[Node]) -> None:
        self.told = {n.name: threading.Event() for n in nodes}
        self.aborts: list[tuple[str, dict]] = []
        self.unreachable: set[str] = set()
        self.tried = {n.name: threading.Event() for n in nodes}

    def call_agent(self, target, python, op, params, timeout=None):
        assert op == "abort"
        self.tried[target.place].set()
        if target.place in self.unreachable:
            raise ConnectionError("connection reset")
        self.aborts.append((target.place, params))
        self.told[target.place].set()
        return {}

    def wait_to_be_told(self, node: Node):
        assert self.told[node.name].wait(10), "the abort never came"
        raise AgentFailed(f"aborted on {node.name}: another node failed", aborted=True)


class Said(Reporter):
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, message: str) -> None:
        self.warnings.append(message)


@pytest.fixture
def barrier(monkeypatch):
    nodes = two_nodes()
    scripted = Barrier(nodes)
    monkeypatch.setattr(agent_client, "call_agent", scripted.call_agent)
    return nodes, scripted


def test_every_answer_in_the_nodes_order_when_every_node_launches(barrier):
    nodes, scripted = barrier
    answers = committing.launch_everywhere(nodes, RUN, lambda n: {"run_id": RUN, "on": n.name})
    assert [a["on"] for a in answers] == ["gpu-a", "gpu-b"]
    assert scripted.aborts == []


def test_one_node_failing_aborts_the_other_and_both_keep_their_old_run(barrier):
    nodes, scripted = barrier

    def call(node):
        if node.name == "gpu-b":
            raise AgentFailed("no space left on device", hint="free some space")
        return scripted.wait_to_be_told(node)

    with pytest.raises(NodesFailed) as failed:
        committing.launch_everywhere(nodes, RUN, call)
    error = failed.value
    assert [(place, p["run_id"]) for place, p in scripted.aborts] == [("gpu-a", RUN)]
    assert "node gpu-b failed: no space left on device" in scripted.aborts[0][1]["reason"]
    assert error.node == "gpu-b"
    assert [(n["node"], n["left"]) for n in error.nodes_json()] == [
        ("gpu-a", OLD_RUN),
        ("gpu-b", OLD_RUN),
    ]
    assert error.message.startswith(f"run {RUN} was launched nowhere: node gpu-b")
    assert "gpu-a: aborted: nothing stopped" in error.message
    assert "gpu-b: failed: nothing stopped" in error.message
    assert error.hint == "free some space"
    assert error.nodes_json()[1] == {
        "node": "gpu-b",
        "left": OLD_RUN,
        "detail": "failed: nothing stopped",
        "error": {"message": "no space left on device", "hint": "free some space"},
    }


def test_a_node_lost_after_the_others_committed_committed_too(barrier):
    nodes, scripted = barrier
    a_launched = threading.Event()

    def call(node):
        if node.name == "gpu-a":
            a_launched.set()
            return {"run_id": RUN}
        assert a_launched.wait(10)
        raise ConnectionError("connection reset by peer")  # a low-level error, as paramiko's

    with pytest.raises(NodesFailed) as failed:
        committing.launch_everywhere(nodes, RUN, call)
    error = failed.value
    assert [(n["node"], n["left"]) for n in error.nodes_json()] == [
        ("gpu-a", NEW_RUN),
        ("gpu-b", NEW_RUN),
    ]
    assert error.message.startswith(f"run {RUN} launched on gpu-a, gpu-b but node gpu-b")
    assert "talking to root@gpu-b failed: connection reset by peer" in error.message
    assert "the other nodes committed, so it did too" in error.nodes_json()[1]["detail"]


def test_a_rollback_names_the_node_whose_launch_failed_not_the_one_it_took_down(barrier):
    nodes, _ = barrier

    def call(node):
        if node.name == "gpu-a":
            raise AgentFailed("stopped: gpu-b could not launch", rolled_back="peer")
        raise AgentFailed("trainer died at start", rolled_back="here", relaunched=True)

    with pytest.raises(NodesFailed) as failed:
        committing.launch_everywhere(nodes, RUN, call)
    error = failed.value
    assert error.node == "gpu-b"
    assert [n["left"] for n in error.nodes_json()] == [NOTHING, OLD_RELAUNCHED]
    assert error.nodes_json()[0]["detail"] == (
        f"run {RUN} was stopped there, as another node could not launch it; nothing runs there"
    )
    assert error.nodes_json()[1]["detail"] == (
        "its launch failed after the old run was stopped; the previous release runs again"
    )
    assert "could not start on node gpu-b (CT 200 on root@gpu-b), so it was taken down" in (
        error.message
    )


def test_a_node_that_cannot_be_told_to_abort_is_named_and_decides_at_its_deadline(barrier):
    nodes, scripted = barrier
    scripted.unreachable.add("gpu-a")
    said = Said()

    def call(node):
        if node.name == "gpu-b":
            raise AgentFailed("bad config")
        # Never told: it gives up at its deadline, after this process tried to tell it.
        assert scripted.tried[node.name].wait(10)
        raise AgentFailed("deadline passed before every node arrived", aborted=True)

    with pytest.raises(NodesFailed) as failed:
        committing.launch_everywhere(nodes, RUN, call, said)
    assert [n["left"] for n in failed.value.nodes_json()] == [OLD_RUN, OLD_RUN]
    assert len(said.warnings) == 1
    assert said.warnings[0].startswith("could not tell node gpu-a (CT 200 on root@gpu-a) to abort")
    assert said.warnings[0].endswith("it decides with the others at its deadline")


def test_one_node_says_its_own_error_and_has_nobody_to_abort(barrier):
    nodes, scripted = barrier

    def call(node):
        raise AgentFailed("bad config")

    with pytest.raises(NodesFailed) as failed:
        committing.launch_everywhere(nodes[:1], RUN, call)
    assert failed.value.message == "bad config" and isinstance(failed.value.cause, AgentFailed)
    assert [(n["node"], n["left"]) for n in failed.value.nodes_json()] == [("gpu-a", OLD_RUN)]
    assert scripted.aborts == []
