"""A network between test containers, in network namespaces the tests make themselves.

    network = Network(size=2)          # 10.231.0.1/24 and 10.231.0.2/24
    network[0].address                 # "10.231.0.1"
    network[0].netns_path              # /proc/<holder>/ns/net, for a container to join
    network.close()                    # holders killed: the namespaces go with their last user

Each endpoint is a network namespace kept alive by a holder process (`unshare --net`
running `sleep`), with `lo` up and one veth `eth0` (as a Proxmox container's net0 is
named) carrying its address and a default route. The other ends of the veths sit on a
bridge in one more namespace of ours, the switch, so any number of endpoints reach each
other. Nothing is ever created or changed in the machine's own network namespace: every
`ip` command runs inside a namespace made here, and a holder counts as ready only once its
namespace is not ours.

Holders die with the test process (parent-death signal), carry the session's pid in
their environment, and holders of sessions that died are killed by reap_stale_holders().
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.231.0.0/24"
INTERFACE = "eth0"
BRIDGE = "br0"
# In each holder's environment: the pid of the test session that made it.
OWNER_ENV = "DFLASHCTL_TEST_NETNS_OWNER"
NEEDED_TOOLS = ("setpriv", "unshare", "nsenter", "ip")


class NetworkUnavailable(RuntimeError):
    """Network namespaces or veths cannot be made here."""


def _netns_link(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


@dataclass
class Holder:
    """A process that holds one network namespace open (it does nothing else)."""

    process: subprocess.Popen
    start_time: int

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def netns_path(self) -> str:
        return f"/proc/{self.pid}/ns/net"

    @classmethod
    def start(cls, timeout: float = 10.0) -> Holder:
        missing = [tool for tool in NEEDED_TOOLS if shutil.which(tool) is None]
        if missing:
            raise NetworkUnavailable(
                f"a test network needs {', '.join(missing)} (apt-get install util-linux iproute2)"
            )
        # setpriv: SIGKILL when the test process dies; unshare --net: a new, empty
        # namespace; the shell says "ready" once it runs inside it.
        process = subprocess.Popen(
            [
                "setpriv",
                "--pdeathsig",
                "KILL",
                "--",
                "unshare",
                "--net",
                "--",
                "/bin/sh",
                "-c",
                "echo ready; exec sleep infinity",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), OWNER_ENV: str(os.getpid())},
            start_new_session=True,
        )
        try:
            line = process.stdout.readline()
        except Exception:
            process.kill()
            raise
        if line.strip() != b"ready":
            process.kill()
            _, err = process.communicate(timeout=timeout)
            raise NetworkUnavailable(f"unshare --net failed: {err.decode(errors='replace')}")
        process.stdout.close()
        process.stderr.close()
        holder = cls(process, _start_time(process.pid) or 0)
        if _netns_link(holder.pid) in (None, _netns_link("self")):
            holder.kill()
            raise NetworkUnavailable("the holder's network namespace is the machine's own")
        return holder

    def alive(self) -> bool:
        return _start_time(self.pid) == self.start_time

    def ip(self, *args: str) -> str:
        """`ip ARGS` inside this namespace (never the machine's own: checked)."""
        if not self.alive() or _netns_link(self.pid) == _netns_link("self"):
            raise NetworkUnavailable(f"namespace holder {self.pid} is gone")
        result = subprocess.run(
            ["nsenter", f"--net={self.netns_path}", "--", "ip", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if result.returncode != 0:
            raise NetworkUnavailable(f"ip {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()


@dataclass
class Endpoint:
    """One container's place on the network: its namespace and address."""

    index: int
    address: str  # e.g. "10.231.0.1"
    prefix_len: int
    holder: Holder = field(repr=False)
    interface: str = INTERFACE

    @property
    def cidr(self) -> str:
        return f"{self.address}/{self.prefix_len}"

    @property
    def netns_path(self) -> str:
        return self.holder.netns_path

    @property
    def holder_pid(self) -> int:
        return self.holder.pid

    @property
    def hwaddr(self) -> str:
        info = json.loads(self.holder.ip("-j", "link", "show", "dev", self.interface))
        return info[0]["address"]

    def state_entry(self) -> str:
        """How the node's state (conf.json "netns") names this namespace: the holder's pid
        and start time, so that a recycled pid is never taken for it."""
        return f"{self.holder.pid} {self.holder.start_time}"


class Network:
    """`size` namespaces on one bridge, addresses .1, .2, ... of `subnet`."""

    def __init__(self, size: int = 2, subnet: str = SUBNET):
        if size < 1:
            raise ValueError("a network needs at least one endpoint")
        net = ipaddress.ip_network(subnet)
        hosts = list(net.hosts())[:size]
        if len(hosts) < size:
            raise ValueError(f"{subnet} has room for {len(hosts)} endpoints, not {size}")
        self.subnet = str(net)
        self.endpoints: list[Endpoint] = []
        self._switch: Holder | None = None
        try:
            self._switch = Holder.start()
            self._switch.ip("link", "add", BRIDGE, "type", "bridge")
            self._switch.ip("link", "set", BRIDGE, "up")
            for index, address in enumerate(hosts):
                self.endpoints.append(self._add_endpoint(index, str(address), net.prefixlen))
        except BaseException:
            self.close()
            raise

    def _add_endpoint(self, index: int, address: str, prefix_len: int) -> Endpoint:
        holder = Holder.start()
        endpoint = Endpoint(index, address, prefix_len, holder)
        try:
            port = f"port{index}"
            # Made in the switch's namespace, one end moved into the endpoint's.
            self._switch.ip(
                "link", "add", port, "type", "veth", "peer", "name", INTERFACE,
                "netns", str(holder.pid),
            )  # fmt: skip
            self._switch.ip("link", "set", port, "master", BRIDGE, "up")
            holder.ip("link", "set", "lo", "up")
            holder.ip("addr", "add", endpoint.cidr, "dev", INTERFACE)
            holder.ip("link", "set", INTERFACE, "up")
            holder.ip("route", "add", "default", "dev", INTERFACE)
        except BaseException:
            holder.kill()
            raise
        return endpoint

    def __getitem__(self, index: int) -> Endpoint:
        return self.endpoints[index]

    def __len__(self) -> int:
        return len(self.endpoints)

    def __iter__(self):
        return iter(self.endpoints)

    def holder_pids(self) -> list[int]:
        holders = [e.holder for e in self.endpoints] + ([self._switch] if self._switch else [])
        return [h.pid for h in holders if h.alive()]

    def close(self) -> None:
        """Kill the holders. A namespace lives on while a container still runs in it."""
        for endpoint in self.endpoints:
            endpoint.holder.kill()
        if self._switch is not None:
            self._switch.kill()


def stale_holders() -> list[int]:
    """Holders whose test session is gone (a killed run's holders: the parent-death
    signal kills them, unless their parent was not the test process itself)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        for variable in environ.split(b"\0"):
            name, _, owner = variable.partition(b"=")
            if name == OWNER_ENV.encode():
                if owner.isdigit() and not Path(f"/proc/{owner.decode()}").exists():
                    found.append(int(entry))
                break
    return found


def reap_stale_holders() -> None:
    for pid in stale_holders():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
