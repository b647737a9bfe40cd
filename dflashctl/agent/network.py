"""The container's network, for a run across several nodes: its own address (the one
the other nodes reach it at), and whether a TCP port can be listened on and reached.

Stdlib only: the interface of the default route from /proc/net/route, its IPv4 address
from the SIOCGIFADDR ioctl (no `ip` or `hostname -I` needed in the container).
"""

import errno
import fcntl
import os
import socket
import struct
import time

from .errors import AgentError
from .processes import process_env

SIOCGIFADDR = 0x8915


def interface_address(name):
    """The IPv4 address of interface `name`, or None."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = struct.pack("256s", name.encode()[:15])
        answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, packed)
    except OSError:
        return None
    finally:
        sock.close()
    return socket.inet_ntoa(answer[20:24])


def proc_rows(path):
    """The rows of a /proc/net table (its heading left out), split; [] when unreadable."""
    try:
        with open(path, encoding="ascii") as f:
            return [line.split() for line in f.read().splitlines()[1:]]
    except OSError:
        return []


def default_route_interface(route_file="/proc/net/route"):
    """The interface of the IPv4 default route (destination 0.0.0.0), or None."""
    for row in proc_rows(route_file):
        if len(row) > 1 and row[1] == "00000000":
            return row[0]
    return None


def addresses():
    """[(interface, IPv4)] of every interface with an address, loopback last."""
    found = []
    for _, name in socket.if_nameindex():
        address = interface_address(name)
        if address:
            found.append((name, address))
    return sorted(found, key=lambda item: item[1].startswith("127."))


def route_toward(address):
    """The interface and source address this machine uses to reach `address` (the
    kernel's own route lookup: a UDP socket's connect sends nothing), or (None, None)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.connect((address, 9))
        local = sock.getsockname()[0]
    except OSError:
        return None, None
    finally:
        sock.close()
    for name, own in addresses():
        if own == local:
            return name, local
    return None, local


def op_address(p):
    """The address the other nodes should use: the default route's interface's, else
    the first interface's that is not loopback; None when there is only loopback.
    With `toward`: also the interface that reaches that address (gloo must be told
    it: it binds what the hostname resolves to, often loopback in a container)."""
    every = addresses()
    chosen = None
    via = default_route_interface()
    for name, address in every:
        if name == via and not address.startswith("127."):
            chosen = address
    if chosen is None:
        outside = [a for _, a in every if not a.startswith("127.")]
        chosen = outside[0] if outside else None
    route = {}
    if p.get("toward"):
        name, local = route_toward(p["toward"])
        route = {"route": {"interface": name, "address": local}}
    return {
        **route,
        "address": chosen,
        "interface": via,
        "addresses": [{"interface": n, "address": a} for n, a in every],
        "hostname": socket.gethostname(),
    }


def _listening_socket(port):
    """Bound to every address, IPv6 and IPv4 at once where the kernel has IPv6 (as
    torchrun's store listens), else every IPv4 address."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 in this kernel
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind((address, port))
            return sock
        except OSError as exc:
            sock.close()
            ipv6_missing = exc.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL)
            if family == socket.AF_INET or not ipv6_missing:
                raise  # e.g. the port is in use: the same answer for IPv4
    raise OSError(errno.EAFNOSUPPORT, "no IPv4 or IPv6 sockets here")


def op_listen(p):
    """Listen on `port` for `seconds` (the doctor's rendezvous check: the other nodes
    probe it meanwhile), or until `expect` connections came (when given); answers with
    who connected, or why it could not listen (the port is taken: a run still holds it?)."""
    try:
        sock = _listening_socket(int(p["port"]))
    except OSError as exc:
        return {"listening": False, "error": exc.strerror or str(exc), "peers": []}
    sock.listen(16)
    sock.settimeout(0.2)
    peers = []
    deadline = time.monotonic() + float(p.get("seconds", 5))
    expect = p.get("expect")
    try:
        while time.monotonic() < deadline and (expect is None or len(peers) < int(expect)):
            try:
                conn, addr = sock.accept()
            except socket.timeout:  # noqa: UP041 (Python 3.6: not yet TimeoutError)
                continue
            peers.append(addr[0][7:] if addr[0].startswith("::ffff:") else addr[0])
            conn.close()
    finally:
        sock.close()
    return {"listening": True, "peers": peers}


def op_probe(p):
    """Open a TCP connection to `address`:`port` within `timeout_s`, retrying until then
    (the listener may start a moment later); say how it went."""
    deadline = time.monotonic() + float(p.get("timeout_s", 5))
    last = "timed out"
    while True:
        try:
            conn = socket.create_connection(
                (p["address"], int(p["port"])), timeout=max(0.1, deadline - time.monotonic())
            )
            conn.close()
            return {"reached": True}
        except OSError as exc:
            last = exc.strerror or str(exc)
        if time.monotonic() >= deadline:
            return {"reached": False, "error": last}
        time.sleep(0.1)


def port_listeners(port):
    """The pids of the processes listening on TCP `port` (IPv4 or IPv6), from
    /proc/net/tcp* and each process's open sockets."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in proc_rows(table):
            if len(row) > 9 and row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{row[9]}]")
    pids = []
    if not inodes:
        return pids
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}") in inodes:
                    pids.append(int(name))
                    break
            except OSError:
                continue
    return sorted(pids)


def check_job_port(workdir, port):
    """Before anything is stopped, on the node that hosts the job's store: torchrun.port
    must be free, or held by a run of this workdir (stopped before the launch). A run of
    another workdir (another experiment in this container) holding it would make every
    rank of the new run die at its rendezvous: refused, naming who holds it."""
    own = os.path.join(workdir, "runs") + os.sep
    for pid in port_listeners(int(port)):
        run_dir = process_env(pid, "DFLASH_RUN_DIR") or ""
        if run_dir.startswith(own):
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            command = "?"
        whose = f" (run {run_dir.rstrip('/')})" if run_dir else ""
        raise AgentError(
            f"torchrun.port {int(port)} is taken by pid {pid}{whose}, not a run of "
            f"{workdir}: {command[:200]}",
            "stop that job, or set torchrun.port (and torchrun.commit_port) to free ports; "
            "nothing was stopped",
        )
