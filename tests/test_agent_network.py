"""The agent's network verbs: the container's own address, a listener and a probe."""

from __future__ import annotations

import socket
import threading

import pytest

from dflashctl.agent import network
from tests.waiting import returns

ROUTES = """\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
veth1\t0000E70A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
veth1\t00000000\t0100E70A\t0003\t0\t0\t0\t00000000\t0\t0\t0
"""


def test_the_default_route_names_the_interface(tmp_path):
    routes = tmp_path / "route"
    routes.write_text(ROUTES)
    assert network.default_route_interface(str(routes)) == "veth1"
    routes.write_text(ROUTES.splitlines()[0] + "\n")  # no default route
    assert network.default_route_interface(str(routes)) is None
    assert network.default_route_interface(str(tmp_path / "missing")) is None


def test_the_address_is_never_loopback_when_another_exists():
    answer = network.op_address({})
    listed = [a["address"] for a in answer["addresses"]]
    assert "127.0.0.1" in listed
    outside = [a for a in listed if not a.startswith("127.")]
    assert answer["address"] == (outside[0] if outside else None) or answer["address"] in outside


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_probe_reaches_a_listener_started_after_it():
    port = free_port()
    heard = {}
    probe = threading.Thread(
        target=lambda: heard.update(
            network.op_probe({"address": "127.0.0.1", "port": port, "timeout_s": 5})
        )
    )
    probe.start()
    answer = network.op_listen({"port": port, "seconds": 1.0})
    probe.join()
    assert heard == {"reached": True}
    assert answer["listening"] and answer["peers"] == ["127.0.0.1"]


def test_a_taken_port_and_an_unreachable_one_say_why():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        answer = network.op_listen({"port": port, "seconds": 0.2})
        assert not answer["listening"] and "in use" in answer["error"]
    refused = network.op_probe({"address": "127.0.0.1", "port": free_port(), "timeout_s": 0.3})
    assert refused["reached"] is False and refused["error"]


def test_a_listener_told_how_many_to_expect_answers_once_they_came():
    port = free_port()
    probes = [
        threading.Thread(
            target=network.op_probe, args=({"address": address, "port": port, "timeout_s": 5},)
        )
        for address in ("127.0.0.1", "127.0.0.1")
    ]
    for probe in probes:
        probe.start()
    # It answers once both came, not after the hour it would wait for more.
    answer = returns(lambda: network.op_listen({"port": port, "seconds": 3600, "expect": 2}))
    for probe in probes:
        probe.join()
    # IPv4 peers of a dual-stack listener are named as IPv4 addresses.
    assert answer == {"listening": True, "peers": ["127.0.0.1", "127.0.0.1"]}


def _listener(run_dir: str | None):
    """A process listening on a port the kernel picks (no window for another test to
    take it between a probe and the bind), as a run's torchrun would; and that port."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DFLASH_RUN_DIR"}
    if run_dir:
        env["DFLASH_RUN_DIR"] = run_dir
    program = (
        "import socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", program, "torchrun-standin"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, int(proc.stdout.readline())


def test_the_job_port_held_by_another_workdirs_run_is_refused_naming_it(tmp_path):
    import socket

    from dflashctl.agent.errors import AgentError
    from dflashctl.agent.network import check_job_port, port_listeners

    workdir = str(tmp_path / "dflash")
    with socket.socket() as held:
        # Bound but not listening: the port is ours and nobody serves on it.
        held.bind(("127.0.0.1", 0))
        check_job_port(workdir, held.getsockname()[1])  # free: nothing to say
    other, port = _listener("/srv/other-experiment/runs/20261204-100000-aaaa")
    try:
        assert port_listeners(port) == [other.pid]
        with pytest.raises(AgentError) as caught:
            check_job_port(workdir, port)
        message = caught.value.message
        assert f"torchrun.port {port} is taken by pid {other.pid}" in message
        assert "run /srv/other-experiment/runs/20261204-100000-aaaa" in message
        assert "torchrun-standin" in message and "nothing was stopped" in caught.value.hint
    finally:
        other.kill()
        other.wait()
    own, port = _listener(f"{workdir}/runs/20261204-110000-bbbb")
    try:
        check_job_port(workdir, port)  # this workdir's own run: stopped before the launch
    finally:
        own.kill()
        own.wait()
