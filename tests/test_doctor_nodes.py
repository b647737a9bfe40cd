"""ops/doctor_nodes.py's checks across the nodes without a host: the rendezvous address
as the first node's agent answers it (scripted here) and whether the nodes agree. The
same checks on two real containers: tests/test_commands_on_containers.py."""

from __future__ import annotations

from types import SimpleNamespace

from dflashctl.ops import doctor_nodes
from dflashctl.ops.doctor_checks import FAIL, PASS, SKIP, WARN, Doctor
from dflashctl.ops.doctor_nodes import NodeCheckup
from dflashctl.remote import agent_client


def config(address=None):
    return SimpleNamespace(
        torchrun=SimpleNamespace(address=address, port=29500),
        container=SimpleNamespace(python="python3", workdir="/root/dflash"),
    )


def checkups(*facts: dict, usable: bool = False) -> list[NodeCheckup]:
    return [
        NodeCheckup(i, name, config(), target=SimpleNamespace(), usable=usable, facts=dict(f))
        for i, (name, f) in enumerate(zip(["gpu-a", "gpu-b"], facts, strict=False))
    ]


def across(checked: list[NodeCheckup], cfg=None) -> dict[str, tuple[str, str]]:
    doctor = Doctor(lambda check: None)
    doctor_nodes.check_across_nodes(doctor, cfg or config(), checked)
    return {c.name: (c.status, c.detail) for c in doctor.checks}


def test_nodes_with_the_same_files_under_different_release_ids_agree():
    found = across(
        checkups(
            {"python": "3.11.7", "torch": "2.13.0", "release": "r1 (files abc123)"},
            {"python": "3.11.7", "torch": "2.13.0", "release": "r2 (files abc123)"},
        )
    )
    assert found["nodes agree"] == (
        PASS,
        "3.11.7, 2.13.0, the same release files (abc123: r1, r2) on every node",
    )
    # Without python on the first node, neither rendezvous check can be made.
    assert found["rendezvous address"] == (SKIP, "skipped: needs python on node gpu-a")
    assert found["rendezvous port"] == (SKIP, "skipped: needs the rendezvous address")


def test_a_different_torch_or_release_is_a_warning_naming_each_node():
    status, detail = across(
        checkups(
            {"python": "3.11.7", "torch": "2.13.0", "release": "r1 (files abc123)"},
            {"python": "3.11.7", "torch": "2.12.1", "release": ""},
        )
    )["nodes agree"]
    assert status == WARN
    assert "torch differs: gpu-a 2.13.0, gpu-b 2.12.1" in detail
    assert "release differs: gpu-a r1 (files abc123), gpu-b none yet" in detail
    assert "Python differs" not in detail


def test_nothing_read_on_the_nodes_skips_the_agreement():
    found = across(checkups({}, {"python": "3.11.7"}))
    assert found["nodes agree"] == (SKIP, "skipped: needs python on the nodes")


def test_a_first_node_with_only_loopback_fails_the_address_and_says_what_to_set(monkeypatch):
    asked = []

    def call_agent(target, python, op, params, timeout=None):
        asked.append(op)
        return {"address": None, "addresses": [{"interface": "lo", "address": "127.0.0.1"}]}

    monkeypatch.setattr(agent_client, "call_agent", call_agent)
    found = across(checkups({}, {}, usable=True))
    status, detail = found["rendezvous address"]
    assert asked == ["address"]
    assert (status, detail) == (
        FAIL,
        "node gpu-a's container has no address the other nodes could reach (only lo 127.0.0.1)",
    )
    assert found["rendezvous port"][0] == SKIP


class Rendezvous:
    """The agents' `listen` (first node) and `probe` (every node) answers, scripted."""

    def __init__(self, listening=True, unreachable=(), peers=None):
        self.listening, self.unreachable, self.peers = listening, set(unreachable), peers
        self.probed: list[tuple[str, int]] = []

    def call_agent(self, target, python, op, params, timeout=None):
        if op == "listen":
            if not self.listening:
                return {"listening": False, "error": "[Errno 98] Address already in use"}
            return {"listening": True, "peers": self.peers or ["10.0.0.5", "10.0.0.6"]}
        assert op == "probe"
        self.probed.append((params["address"], params["port"]))
        if target.name in self.unreachable:
            return {"reached": False, "error": "timed out"}
        return {"reached": True}


def nodes_with_python(running=None) -> list[NodeCheckup]:
    found = checkups({}, {}, usable=True)
    for checkup in found:
        checkup.target = SimpleNamespace(name=checkup.name)
    found[0].running = running
    return found


def port_check(monkeypatch, agents: Rendezvous, running=None) -> tuple[str, str]:
    monkeypatch.setattr(agent_client, "call_agent", agents.call_agent)
    found = across(nodes_with_python(running), config(address="10.0.0.5"))
    assert found["rendezvous address"] == (PASS, "10.0.0.5 (torchrun.address)")
    return found["rendezvous port"]


def test_every_node_reaching_the_first_nodes_listener_passes(monkeypatch):
    agents = Rendezvous()
    assert port_check(monkeypatch, agents) == (
        PASS,
        "node gpu-a listens on port 29500; all 2 nodes reach 10.0.0.5:29500",
    )
    assert agents.probed == [("10.0.0.5", 29500)] * 2


def test_a_node_that_cannot_reach_the_port_is_named(monkeypatch):
    status, detail = port_check(monkeypatch, Rendezvous(unreachable={"gpu-b"}))
    assert (status, detail) == (
        FAIL,
        "node gpu-b cannot reach 10.0.0.5:29500 on node gpu-a (gpu-b: timed out)",
    )


def test_reaching_something_else_at_the_address_fails(monkeypatch):
    status, detail = port_check(monkeypatch, Rendezvous(peers=["10.0.0.5"]))
    assert status == FAIL
    assert (
        detail
        == "1 of 2 nodes reached something at 10.0.0.5:29500 that is not node gpu-a's container"
    )


def test_a_taken_port_fails_but_the_runs_own_store_only_warns(monkeypatch):
    status, detail = port_check(monkeypatch, Rendezvous(listening=False))
    assert status == FAIL and "node gpu-a cannot listen on port 29500" in detail
    status, detail = port_check(monkeypatch, Rendezvous(listening=False), running="run-7")
    assert status == WARN
    assert "port 29500 on node gpu-a is in use while run run-7 runs there" in detail
