# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""stop, status, runs and doctor on two nodes that are two containers of the test host
(a real sshd, real containers): one node stopped or unreachable, the other still
answers, and the error names the node."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dflashctl.config.schema import load_config
from dflashctl.ops.deploy import DeployOptions, deploy
from tests.host.fixtures import CONTAINER_KIND
from tests.json_answers import flat, one_node
from tests.test_deploy_container import ct_pid_alive
from tests.test_deploy_support import write_trainer

pytestmark = pytest.mark.slow

DFLASHCTL = [sys.executable, "-m", "dflashctl"]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def two_cts(tmp_path, make_container, write_config, monkeypatch):
    """(write(**overrides) -> config path, [container a, container b])."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    containers = [make_container(200), make_container(201)]
    source = write_trainer(tmp_path / "src")

    def write(node_b: dict | None = None, **overrides) -> Path:
        return write_config(
            tmp_path,
            trainer_source=source,
            nodes=[
                {"name": "a", "container": {"vmid": 200}},
                {"name": "b", "container": {"vmid": 201}, **(node_b or {})},
            ],
            **{
                "trainer.entry": "train.py",
                "trainer.args": ["--sleep", "60", "--on-term", "checkpoint"],
                "run.stop_grace_s": 3,
                **overrides,
            },
        )

    return write, containers


def cli(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASHCTL, *args, "-c", str(path)], capture_output=True, text=True, timeout=180
    )


def deploy_each(path: Path) -> list[dict]:
    config = load_config(path)
    summaries = []
    for index in range(len(config.nodes)):
        code, summary = deploy(config.for_node(index), DeployOptions(detach=True))
        assert code == 0
        summaries.append(one_node(summary))
    return summaries


def test_stop_and_status_on_both_containers_then_with_one_stopped(two_cts):
    write, (ct_a, ct_b) = two_cts
    path = write()
    run_a, run_b = deploy_each(path)

    status = cli(path, "status", "--json")
    assert status.returncode == 0, status.stderr
    nodes = flat(json.loads(status.stdout))["nodes"]
    assert [(n["node"], n["container"]["vmid"], n["active_run"]["id"]) for n in nodes] == [
        ("a", 200, run_a["run_id"]),
        ("b", 201, run_b["run_id"]),
    ]
    assert [n["active_run"]["status"] for n in nodes] == ["running", "running"]
    text = cli(path, "status").stdout.splitlines()
    assert text[0].split()[:3] == ["node", "where", "container"]
    assert text[1].startswith("a ") and "CT 200 on root@127.0.0.1:" in text[1]
    assert text[2].startswith("b ") and "CT 201 on root@127.0.0.1:" in text[2]

    done = cli(path, "stop")
    assert done.returncode == 0, done.stderr
    assert f"a: stopped run {run_a['run_id']}" in done.stderr
    assert f"b: stopped run {run_b['run_id']}" in done.stderr
    assert not ct_pid_alive(ct_a, run_a["pid"]) and not ct_pid_alive(ct_b, run_b["pid"])
    for ct, run in ((ct_a, run_a), (ct_b, run_b)):
        checkpointed = ct.host_path(f"/root/dflash/runs/{run['run_id']}/checkpointed")
        assert checkpointed.read_text() == "yes\n"

    # Container b stopped: status says so (not an error, as for one node) ...
    ct_b.stop()
    status = cli(path, "status")
    assert status.returncode == 0, status.stderr
    row_b = status.stdout.splitlines()[2]
    assert row_b.split()[0] == "b" and " stopped " in row_b
    assert row_b.endswith("unknown while the container is stopped")
    # ... while stop cannot reach its runs: node a is still stopped, b is named.
    again = one_node(deploy(load_config(path).for_node(0), DeployOptions(detach=True))[1])
    done = cli(path, "stop")
    assert done.returncode == 3
    assert f"a: stopped run {again['run_id']}" in done.stderr
    assert "error: node b (CT 201 on root@127.0.0.1:" in done.stderr
    assert "stopping runs: container 201" in done.stderr
    assert not ct_pid_alive(ct_a, again["pid"])


def test_an_unreachable_host_is_named_and_the_other_node_still_answers(two_cts):
    write, _ = two_cts
    path = write()
    (run_a, _) = deploy_each(path)
    port = closed_port()
    path = write(node_b={"host": {"port": port}})

    status = cli(path, "status", "--json")
    assert status.returncode == 3
    a, b = flat(json.loads(status.stdout))["nodes"]
    assert a["active_run"]["id"] == run_a["run_id"] and a["error"] is None
    assert b["error"]["message"] == f"127.0.0.1 port {port} refused the connection"
    assert (
        f"error: node b (CT 201 on root@127.0.0.1:{port}) status: 127.0.0.1 port {port} "
        "refused the connection" in status.stderr
    )

    runs = cli(path, "runs")
    assert runs.returncode == 3
    assert run_a["run_id"] in runs.stdout and "  a  " in runs.stdout
    assert "error: node b (CT 201 on root@127.0.0.1:" in runs.stderr

    done = cli(path, "stop", "--json")
    assert done.returncode == 3
    a, b = flat(json.loads(done.stdout))["nodes"]
    assert [s["run_id"] for s in a["stopped"]] == [run_a["run_id"]]
    assert b["stopped"] == [] and "refused the connection" in b["error"]["message"]

    doctor = cli(path, "doctor", "--json")
    assert doctor.returncode == 3
    checks = {(c.get("node"), c["name"]): c for c in flat(json.loads(doctor.stdout))["checks"]}
    assert checks[("a", "torch")]["status"] == "pass"
    assert checks[("b", "SSH reachable")]["detail"] == (
        f"127.0.0.1 port {port} refused the connection"
    )
    assert checks[("b", "python")]["status"] == "skip"
    assert checks[(None, "rendezvous port")]["status"] == "skip"  # needs node b, or an address


def test_doctor_checks_every_container_and_the_rendezvous(two_cts):
    write, _ = two_cts
    port = closed_port()
    path = write(torchrun={"address": "127.0.0.1", "port": port})
    done = cli(path, "doctor", "--json")
    checks = flat(json.loads(done.stdout))["checks"]
    by_node: dict[str | None, dict[str, str]] = {}
    for check in checks:
        by_node.setdefault(check.get("node"), {})[check["name"]] = check
    assert by_node["a"]["container runs"]["detail"].startswith("container 200 (ct200) is running")
    assert by_node["b"]["container runs"]["detail"].startswith("container 201 (ct201) is running")
    assert by_node["a"]["torch"]["status"] == by_node["b"]["torch"]["status"] == "pass"
    across = by_node[None]
    assert across["nodes agree"]["status"] == "pass"
    assert across["nodes agree"]["detail"].endswith("no release yet on every node")
    rendezvous = across["rendezvous port"]
    if CONTAINER_KIND.get("kind") == "lxc":
        # Each LXC container has a network namespace of its own, with only a loopback
        # interface (down here): container b's 127.0.0.1 is not container a's.
        assert done.returncode == 3
        assert rendezvous["status"] == "fail"
        detail = rendezvous["detail"]
        assert f"cannot reach 127.0.0.1:{port} on node a (" in detail
        assert "; b: " in detail or "(b: " in detail  # every failed node named, with why
        assert "torchrun.address" in rendezvous["fix"]
    else:  # bubblewrap sandboxes share the host's network
        assert done.returncode == 0, done.stdout
        assert rendezvous["status"] == "pass"

    text = cli(path, "doctor").stdout
    assert "\nnode a\n  ✓ SSH reachable" in text and "\nnode b\n  ✓ SSH reachable" in text
    assert "\nacross the nodes\n  ✓ rendezvous address   127.0.0.1 (torchrun.address)" in text


def test_doctor_without_an_address_to_rendezvous_at_says_to_set_one(two_cts):
    if CONTAINER_KIND.get("kind") != "lxc":
        pytest.skip("only LXC containers have a network of their own here")
    write, _ = two_cts
    done = cli(write(), "doctor", "--json")
    assert done.returncode == 3
    checks = {c["name"]: c for c in flat(json.loads(done.stdout))["checks"] if "node" not in c}
    address = checks["rendezvous address"]
    assert checks["rendezvous port"]["detail"] == "skipped: needs the rendezvous address"
    assert address["status"] == "fail"
    # Its loopback interface only, here not even up: nothing the other nodes can use.
    assert address["detail"].startswith(
        "node a's container has no address the other nodes could reach ("
    )
    assert "set torchrun.address" in address["fix"]


def test_doctor_and_status_across_two_hosts_on_one_network(
    tmp_path, pve_host, pve_host2, shared_known_hosts, make_container, container_network,
    write_config, monkeypatch,
):  # fmt: skip
    """Two Proxmox hosts, a container on each in one network: the rendezvous address
    comes from the first container's default route, and the other host's container
    reaches its port; status has a row per host's container."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    make_container(200, network=container_network[0])
    make_container(201, host=pve_host2, network=container_network[1])
    port = closed_port()
    path = write_config(
        tmp_path,
        trainer_source=write_trainer(tmp_path / "src"),
        nodes=[
            {"name": "a", "container": 200},
            {
                "name": "b",
                "host": {"port": pve_host2.port},
                "container": 201,
                "proxmox": {"node": pve_host2.node},
            },
        ],  # fmt: skip
        torchrun={"port": port},
        **{"host.known_hosts": str(shared_known_hosts), "trainer.entry": "train.py"},
    )
    done = cli(path, "doctor", "--json")
    checks = {(c.get("node"), c["name"]): c for c in flat(json.loads(done.stdout))["checks"]}
    assert done.returncode == 0, done.stdout
    a_address = container_network[0].address
    assert checks[(None, "rendezvous address")]["detail"] == (
        f"{a_address} (eth0): node a's container address on its default route"
    )
    assert checks[(None, "rendezvous port")]["detail"] == (
        f"node a listens on port {port}; all 2 nodes reach {a_address}:{port}"
    )
    assert checks[("b", "SSH reachable")]["detail"].startswith(
        f"127.0.0.1 port {pve_host2.port} answers"
    )

    status = cli(path, "status", "--json")
    assert status.returncode == 0, status.stderr
    nodes = flat(json.loads(status.stdout))["nodes"]
    assert [(n["node"], n["proxmox_node"], n["container"]["status"]) for n in nodes] == [
        ("a", "pve", "running"),
        ("b", pve_host2.node, "running"),
    ]
