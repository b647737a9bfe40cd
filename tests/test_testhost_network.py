"""The test host across nodes: a second sshd host (pve2) and a network between containers
made in namespaces of our own (tests/host/netns.py). Commands reach the containers as
dflashctl's do: ssh to each host (one shared known_hosts, strict), then `pct exec`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.host import netns, sshd, state
from tests.host.containers import Container

PYTHON = sys.executable  # write_config's container.python: visible in every container


def on_host(host, *argv: str, known_hosts: Path) -> subprocess.Popen:
    """argv on `host` over the system ssh client, strict about the host key; not waited for."""
    return subprocess.Popen(
        host.ssh_argv(*argv, known_hosts=known_hosts),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_on(host, *argv: str, known_hosts: Path, timeout: float = 60):
    return subprocess.run(
        host.ssh_argv(*argv, known_hosts=known_hosts),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def in_container(vmid: int, script: str, *args: str) -> list[str]:
    """The argv that runs a Python script in container `vmid` through pct."""
    return ["pct", "exec", str(vmid), "--", PYTHON, "-c", textwrap.dedent(script), *args]


def host_interfaces() -> list[str]:
    """The interfaces of the machine's own network namespace (only read, never changed)."""
    shown = subprocess.run(["ip", "-j", "link"], capture_output=True, text=True, check=True)
    return sorted(link["ifname"] for link in json.loads(shown.stdout))


def our_holders() -> list[int]:
    """Namespace holders of this test session still alive."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if f"{netns.OWNER_ENV}={os.getpid()}".encode() in environ.split(b"\0"):
            found.append(int(entry))
    return found


# -- two hosts -------------------------------------------------------------------------------


def test_two_hosts_answer_with_their_own_keys_and_containers(
    pve_host, pve_host2, shared_known_hosts, make_container
):
    make_container(200, hostname="first")
    make_container(200, hostname="second", host=pve_host2)
    make_container(201, running=False, host=pve_host2)
    assert pve_host2.port != pve_host.port
    assert pve_host2.host_key_line.split()[2] != pve_host.host_key_line.split()[2]
    assert pve_host2.identity_file == pve_host.identity_file  # one client key for both
    assert shared_known_hosts.read_text().splitlines() == [
        pve_host.host_key_line,
        pve_host2.host_key_line,
    ]

    answers = {}
    for host in (pve_host, pve_host2):
        result = run_on(
            host,
            "sh",
            "-c",
            "pct list; pct exec 200 -- hostname; pvesh get /nodes --output-format json",
            known_hosts=shared_known_hosts,
        )
        assert result.returncode == 0, result.stderr
        answers[host.node] = result.stdout.splitlines()
    assert [line.split()[:2] for line in answers["pve"][1:2]] == [["200", "running"]]
    assert len(answers["pve"]) == 4  # header, one container, hostname, nodes
    assert answers["pve"][2] == "first"
    assert json.loads(answers["pve"][3])[0]["node"] == "pve"
    assert [line.split()[:2] for line in answers["pve2"][1:3]] == [
        ["200", "running"],
        ["201", "stopped"],
    ]
    assert answers["pve2"][3] == "second"
    assert json.loads(answers["pve2"][4])[0]["node"] == "pve2"

    # Each host's own known_hosts trusts only that host.
    refused = run_on(pve_host2, "true", known_hosts=pve_host.known_hosts)
    assert refused.returncode == 255 and "Host key verification failed" in refused.stderr
    # pve2's pvesh does not know pve's containers by node name.
    other = run_on(pve_host2, "pvesh", "get", "/nodes/pve/lxc", known_hosts=shared_known_hosts)
    assert other.returncode == 255 and "hostname lookup 'pve' failed" in other.stderr


def test_write_config_for_the_second_host(pve_host2, write_config, tmp_path):
    from dflashctl.config.schema import load_config

    config = load_config(write_config(tmp_path, vmid=201, host=pve_host2))
    assert (config.host.port, config.proxmox.node) == (pve_host2.port, "pve2")
    assert config.host.known_hosts == str(pve_host2.known_hosts)


def test_known_hosts_for_several_servers(pve_host, pve_host2, tmp_path):
    path = sshd.write_known_hosts(tmp_path / "sub" / "known_hosts", pve_host2, pve_host)
    assert path.read_text() == f"{pve_host2.host_key_line}\n{pve_host.host_key_line}\n"


# -- the network -----------------------------------------------------------------------------

ADDRESSES = """
import socket, sys
# The address the kernel picks to reach the peer: this container's own on the network.
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((sys.argv[1], 9))
routes = open("/proc/net/route").read().split("\\n")[1:]
default = [r.split()[0] for r in routes if r.split()[1:2] == ["00000000"]]
# Its hostname resolves to no address (no DNS, no /etc/hosts entry): gloo would fall back
# to loopback, so multi-node runs must name the interface (GLOO_SOCKET_IFNAME).
try:
    resolved = socket.getaddrinfo(socket.gethostname(), None)[0][4][0]
except socket.gaierror:
    resolved = "unresolved"
print(probe.getsockname()[0], ",".join(default), resolved)
"""

SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
conn, (peer, _) = server.accept()
conn.sendall(f"hello {peer}".encode())
conn.shutdown(socket.SHUT_WR)
print(conn.recv(100).decode(), flush=True)
"""

CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20) as conn:
    conn.sendall(b"from " + conn.getsockname()[0].encode())
    conn.shutdown(socket.SHUT_WR)
    print(conn.recv(100).decode())
"""


def tcp_exchange(server_host, server_ct, client_host, client_ct, known_hosts) -> tuple[str, str]:
    """A TCP server in one container, a client in the other, both through pct over ssh;
    returns what each side received."""
    address = server_ct.address
    server = on_host(
        server_host,
        *in_container(server_ct.vmid, SERVER, address, "4100"),
        known_hosts=known_hosts,
    )
    try:
        assert server.stdout.readline() == "listening\n", server.stderr.read()
        client = run_on(
            client_host,
            *in_container(client_ct.vmid, CLIENT, address, "4100"),
            known_hosts=known_hosts,
        )
        assert client.returncode == 0, client.stderr
        out, err = server.communicate(timeout=30)
        assert server.returncode == 0, err
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return out.strip(), client.stdout.strip()


def test_containers_on_two_hosts_reach_each_other_over_tcp(
    pve_host, pve_host2, shared_known_hosts, make_container, container_network
):
    before = host_interfaces()
    a = make_container(200, network=container_network[0])
    b = make_container(201, host=pve_host2, network=container_network[1])
    assert (a.address, b.address) == ("10.231.0.1", "10.231.0.2")
    own_netns = os.readlink("/proc/self/ns/net")
    assert os.readlink(f"/proc/{a.init_pid()}/ns/net") != own_netns
    assert os.readlink(f"/proc/{b.init_pid()}/ns/net") != own_netns

    for host, ct, peer in ((pve_host, a, b), (pve_host2, b, a)):
        seen = run_on(
            host, *in_container(ct.vmid, ADDRESSES, peer.address), known_hosts=shared_known_hosts
        )
        assert seen.returncode == 0, seen.stderr
        assert seen.stdout.split() == [ct.address, "eth0", "unresolved"]

    assert tcp_exchange(pve_host, a, pve_host2, b, shared_known_hosts) == (
        "from 10.231.0.2",
        "hello 10.231.0.2",
    )
    assert tcp_exchange(pve_host2, b, pve_host, a, shared_known_hosts) == (
        "from 10.231.0.1",
        "hello 10.231.0.1",
    )
    assert host_interfaces() == before  # the machine's own network untouched


GLOO = """
import datetime, os, sys
os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # else gloo binds what the hostname resolves to
import torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group(
    "gloo", init_method="tcp://10.231.0.1:29500", rank=rank, world_size=2,
    timeout=datetime.timedelta(seconds=60),
)
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(f"rank {rank}: {value.item()}", flush=True)
dist.destroy_process_group()
"""


def test_gloo_all_reduce_between_containers_on_two_hosts(
    pve_host, pve_host2, shared_known_hosts, make_container, container_network
):
    a = make_container(200, network=container_network[0])
    b = make_container(201, host=pve_host2, network=container_network[1])
    ranks = [
        on_host(host, *in_container(ct.vmid, GLOO, str(rank)), known_hosts=shared_known_hosts)
        for rank, (host, ct) in enumerate(((pve_host, a), (pve_host2, b)))
    ]
    results = []
    try:
        for process in ranks:
            out, err = process.communicate(timeout=180)
            results.append((process.returncode, out.strip(), err))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert [(code, out) for code, out, _ in results] == [
        (0, "rank 0: 3.0"),
        (0, "rank 1: 3.0"),
    ], results


def test_pvesh_lists_a_containers_interfaces(
    pve_host, shared_known_hosts, make_container, container_network
):
    ct = make_container(200, network=container_network[0])
    make_container(201, running=False, network=container_network[1])
    result = run_on(
        pve_host,
        "sh",
        "-c",
        "pvesh get /nodes/pve/lxc/200/interfaces --output-format json; echo; "
        "pvesh get /nodes/pve/lxc/201/interfaces --output-format json",
        known_hosts=shared_known_hosts,
    )
    assert result.returncode == 0, result.stderr
    running, stopped = result.stdout.split("\n", 1)
    interfaces = {entry["name"]: entry for entry in json.loads(running)}
    assert interfaces["lo"]["inet"] == "127.0.0.1/8"
    assert interfaces["eth0"] == {
        "name": "eth0",
        "hwaddr": ct.network.hwaddr,
        "inet": "10.231.0.1/24",
        "inet6": interfaces["eth0"]["inet6"],  # link-local, made by the kernel
    }
    assert stopped.strip() == ""  # nothing for a stopped container, as on a real node


def test_a_restarted_container_keeps_its_network_and_a_gone_one_fails_clearly(
    pve_host, shared_known_hosts, make_container, make_network
):
    network = make_network(1)
    ct = make_container(200, network=network[0])
    restarted = run_on(
        pve_host,
        "sh",
        "-c",
        f"pct stop 200 && pct start 200 && pct exec 200 -- {PYTHON} -c "
        "'import socket; print(socket.create_server((\"10.231.0.1\", 4200)).getsockname()[0])'",
        known_hosts=shared_known_hosts,
    )
    assert (restarted.returncode, restarted.stdout) == (0, "10.231.0.1\n"), restarted.stderr
    ct.stop()
    network.close()
    started = run_on(pve_host, "pct", "start", "200", known_hosts=shared_known_hosts)
    assert started.returncode == 255
    assert "its network namespace (holder pid" in started.stderr
    assert not ct.is_running()


def test_closing_the_network_and_containers_leaves_no_holders(pve_host, pve_host2):
    network = netns.Network(3)
    try:
        assert [e.address for e in network] == ["10.231.0.1", "10.231.0.2", "10.231.0.3"]
        assert len(network.holder_pids()) == 4  # three endpoints and the switch
        assert sorted(our_holders()) == sorted(network.holder_pids())
        made = []
        for vmid, host, endpoint in ((300, pve_host, network[0]), (301, pve_host2, network[2])):
            state.create_container(host.state_dir, vmid, netns=endpoint.state_entry())
            made.append(Container(host.state_dir, vmid, network=endpoint))
            made[-1].start()
        reached = made[0].exec([PYTHON, "-c", CLIENT_CONNECT_REFUSED, "10.231.0.3"])
        assert reached.stdout == "refused\n", reached.stderr  # the peer answered (RST)
        for handle in made:
            pids = handle.pids()
            handle.destroy()
            assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    finally:
        network.close()
    assert network.holder_pids() == [] and our_holders() == []
    assert state.list_containers(pve_host.state_dir) == []
    assert state.list_containers(pve_host2.state_dir) == []


CLIENT_CONNECT_REFUSED = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 1), timeout=10)
except ConnectionRefusedError:
    print("refused")
"""


def test_holders_of_a_dead_session_are_reaped(pve_host):
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no live session has (until reused, long after this test)
    holder = subprocess.Popen(
        ["unshare", "--net", "--", "sleep", "300"],
        env={"PATH": os.environ["PATH"], netns.OWNER_ENV: str(gone.pid)},
    )
    try:
        ours = netns.Holder.start()
        try:
            # Popen returns once the child has exec'd, with this environment.
            assert holder.pid in netns.stale_holders()
            netns.reap_stale_holders()
            assert holder.wait(timeout=60) == -9
            assert ours.alive()  # this session's holders stay
        finally:
            ours.kill()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_network_needs_an_endpoint_and_room_for_them():
    with pytest.raises(ValueError, match="at least one endpoint"):
        netns.Network(0)
    with pytest.raises(ValueError, match="room for 2 endpoints, not 3"):
        netns.Network(3, subnet="10.231.0.0/30")


def test_a_missing_tool_is_named(monkeypatch):
    monkeypatch.setattr(netns, "NEEDED_TOOLS", ("ip", "no-such-tool-here"))
    with pytest.raises(netns.NetworkUnavailable, match="needs no-such-tool-here \\(apt-get"):
        netns.Holder.start()


TORCHRUN_WORKER = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")  # env:// from torchrun
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {value.item()}", flush=True)
dist.destroy_process_group()
"""


def test_torchrun_static_rendezvous_across_containers_on_two_hosts(
    pve_host, pve_host2, shared_known_hosts, make_container, container_network
):
    """What `dflashctl deploy` launches on 2 nodes: torchrun with a static rendezvous at
    the first container's address, gloo on the containers' eth0."""
    nodes = [
        (pve_host, make_container(200, network=container_network[0])),
        (pve_host2, make_container(201, host=pve_host2, network=container_network[1])),
    ]
    launches = []
    for rank, (host, ct) in enumerate(nodes):
        ct.host_path("/root/worker.py").write_text(TORCHRUN_WORKER)
        launches.append(
            on_host(
                host,
                *["pct", "exec", str(ct.vmid), "--", "env", "GLOO_SOCKET_IFNAME=eth0", PYTHON],
                *["-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank)],
                *["--nproc-per-node", "1", "--master-addr", nodes[0][1].address],
                *["--master-port", "29400", "/root/worker.py"],
                known_hosts=shared_known_hosts,
            )
        )
    results = []
    try:
        for process in launches:
            out, err = process.communicate(timeout=180)
            results.append((process.returncode, out.strip(), err))
    finally:
        for process in launches:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert [(code, out) for code, out, _ in results] == [
        (0, "rank 0 of 2: 3.0"),
        (0, "rank 1 of 2: 3.0"),
    ], results
