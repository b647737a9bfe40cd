"""`dflashctl doctor` over the nodes: every check of one target on each node (all at
once, each line shown as soon as the nodes before it are done), then what only nodes
that meet need:

  rendezvous address   torchrun.address, else the first node's container address
                       (the agent's `address` verb), as a launch would pick it
  rendezvous port      the first node's container listens on torchrun.port while every
                       node (the first too: its torchrun connects there as well) opens a
                       connection to address:port, as torchrun's store clients will
  nodes agree          Python, torch and the current release the same on every node
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from dflashctl import hints
from dflashctl.config.schema import Config
from dflashctl.errors import ConfigError, DflashError, HostError
from dflashctl.ops.doctor_checks import FAIL, PASS, WARN, Check, Doctor, check_target
from dflashctl.remote import agent_client
from dflashctl.remote.deploy_target import Target

# The listener waits this long at most; each probe retries until its own timeout (the
# listener's agent may start a moment after a probe's): together well under 10 s.
LISTEN_S = 8.0
PROBE_TIMEOUT_S = 6.0


@dataclass
class NodeCheckup:
    """One node's checks, and what the checks across the nodes need from it."""

    index: int
    name: str
    config: Config
    target: Target | None = None
    usable: bool = False  # its python runs: the agent can be asked things there
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)  # python, torch, release
    running: str | None = None  # the id of the run that runs there now, if any


class InOrder:
    """Each node's checks into `doctor` as they are made, the nodes in their order: the
    first node still checking shows its lines live, a later one's wait for it."""

    def __init__(self, doctor: Doctor, count: int) -> None:
        self.doctor, self.turn, self.lock = doctor, 0, threading.Lock()
        self.kept: list[list[Check]] = [[] for _ in range(count)]
        self.done = [False] * count

    def add(self, index: int, check: Check) -> None:
        with self.lock:
            self.kept[index].append(check)
            self._show()

    def finish(self, index: int) -> None:
        with self.lock:
            self.done[index] = True
            self._show()

    def _show(self) -> None:
        while self.turn < len(self.kept):
            for check in self.kept[self.turn]:
                self.doctor.add(check)
            self.kept[self.turn] = []
            if not self.done[self.turn]:
                return
            self.turn += 1


def check_node(index: int, config: Config, shown: InOrder) -> NodeCheckup:
    """One node's checks (`config`: Config.for_node's), each naming its node, to
    `shown` as they are made; also what the checks across the nodes need from it."""
    from dflashctl.remote.connect import open_target

    name = config.nodes[0].label()
    checkup = NodeCheckup(index, name, config)
    doctor = Doctor(lambda check: shown.add(index, replace(check, node=name)))
    try:
        checkup.target = open_target(config)
    except ConfigError as exc:  # ~/.ssh/config unreadable
        doctor.add(Check("SSH reachable", FAIL, exc.message, exc.hint, True))
        doctor.skip_rest("needs SSH")
    else:
        checkup.usable = check_target(doctor, config, checkup.target)
    checkup.checks = [replace(c, node=name) for c in doctor.checks]
    passed = {c.name: c.detail for c in checkup.checks if c.status in (PASS, WARN)}
    if "python" in passed:
        checkup.facts["python"] = passed["python"].split(" (")[0]
    if "torch" in passed:
        checkup.facts["torch"] = passed["torch"].split(",")[0]
    if checkup.usable:
        _inspect(checkup)
    return checkup


def _inspect(checkup: NodeCheckup) -> None:
    """The release `current` names there, as `<id> (files <digest of its real
    manifest>)` (nodes deployed one by one have releases of different ids but the same
    files; "" when none yet), and the run running there. Nothing when it cannot be read
    (the checks above said why). This also leaves the agent there for the rendezvous
    check's quick calls."""
    from dflashctl.ops.deploy import inspect

    assert checkup.target is not None
    try:
        answer = inspect(checkup.config, checkup.target, may_start=False)
    except DflashError:
        return
    running = [t["run_id"] for t in answer.get("to_stop") or [] if t.get("kind") == "active"]
    checkup.running = running[0] if running else None
    if not answer.get("release"):
        checkup.facts["release"] = ""
        return
    text = json.dumps(answer.get("manifest") or {}, sort_keys=True).encode()
    digest = hashlib.sha256(text).hexdigest()[:12]
    checkup.facts["release"] = f"{answer['release']} (files {digest})"


def check_every_node(config: Config, doctor: Doctor) -> list[NodeCheckup]:
    """Each node's checks, all at once, into `doctor` in the nodes' order. Their
    targets stay open for the checks across the nodes: close_checkups after."""
    configs = config.node_configs()
    shown = InOrder(doctor, len(configs))

    def one(index: int) -> NodeCheckup:
        try:
            return check_node(index, configs[index], shown)
        finally:
            shown.finish(index)

    with ThreadPoolExecutor(len(configs), thread_name_prefix="doctor") as pool:
        return list(pool.map(one, range(len(configs))))


def check_across_nodes(doctor: Doctor, config: Config, checkups: list[NodeCheckup]) -> None:
    """The rendezvous address and port, and whether the nodes agree (several nodes)."""
    address = _address_check(doctor, config, checkups)
    if address is not None:
        _port_check(doctor, config, checkups, address)
    else:
        doctor.skip("rendezvous port", "needs the rendezvous address")
    _agreement_check(doctor, checkups)


def close_checkups(checkups: list[NodeCheckup]) -> None:
    for checkup in checkups:
        if checkup.target is not None:
            checkup.target.close()


# --------------------------------------------------------------------------- rendezvous


def _address_check(doctor: Doctor, config: Config, checkups: list[NodeCheckup]) -> str | None:
    first = checkups[0]
    setting = config.torchrun.address
    if setting is not None:
        doctor.add(Check("rendezvous address", PASS, f"{setting} (torchrun.address)"))
        return setting
    if not first.usable:
        doctor.skip("rendezvous address", f"needs python on node {first.name}")
        return None
    address = None

    def probe() -> str:
        nonlocal address
        assert first.target is not None
        answer = agent_client.call_agent(first.target, first.config.container.python, "address", {})
        if not answer.get("address"):
            found = ", ".join(
                f"{a['interface']} {a['address']}" for a in answer.get("addresses", [])
            )
            raise HostError(
                f"node {first.name}'s container has no address the other nodes could reach "
                + (f"(only {found})" if found else "(no interface there has an address)"),
                hint="give the container a network (a bridge in its Proxmox config), or set "
                f"torchrun.address to an address of node {first.name} that every node reaches",
            )
        address = str(answer["address"])
        via = f" ({answer['interface']})" if answer.get("interface") else ""
        return f"{address}{via}: node {first.name}'s container address on its default route"

    doctor.run("rendezvous address", probe)
    return address


def _port_check(doctor: Doctor, config: Config, checkups: list[NodeCheckup], address: str) -> None:
    """A listener on the first node while every node connects to address:port."""
    port = config.torchrun.port
    first = checkups[0]
    where = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    unusable = [c.name for c in checkups if not c.usable]
    if unusable:
        doctor.skip("rendezvous port", f"needs python on node {', '.join(unusable)}")
        return

    def listen() -> dict[str, Any]:
        assert first.target is not None
        params = {"port": port, "seconds": LISTEN_S, "expect": len(checkups)}
        return agent_client.call_agent(
            first.target, first.config.container.python, "listen", params, timeout=LISTEN_S + 60
        )

    def probe(checkup: NodeCheckup) -> dict[str, Any]:
        assert checkup.target is not None
        params = {"address": address, "port": port, "timeout_s": PROBE_TIMEOUT_S}
        return agent_client.call_agent(
            checkup.target,
            checkup.config.container.python,
            "probe",
            params,
            timeout=PROBE_TIMEOUT_S + 60,
        )

    start = time.monotonic()
    with ThreadPoolExecutor(len(checkups) + 1, thread_name_prefix="rendezvous") as pool:
        listening = pool.submit(listen)
        probes = [pool.submit(probe, c) for c in checkups]
        try:
            heard = listening.result()
        except DflashError as exc:
            heard = {"listening": False, "error": exc.message}
        reached: list[tuple[str, bool, str]] = []
        for checkup, future in zip(checkups, probes, strict=True):
            try:
                answer = future.result()
            except DflashError as exc:
                answer = {"reached": False, "error": exc.message}
            reached.append((checkup.name, bool(answer.get("reached")), answer.get("error") or ""))
    seconds = time.monotonic() - start
    doctor.add(
        Check(
            "rendezvous port",
            *_port_verdict(port, where, address, first, heard, reached),
            seconds=seconds,
        )
    )


def _port_verdict(
    port: int, where: str, address: str, first: NodeCheckup, heard: dict, reached: list
) -> tuple[str, str, str | None]:
    """The port check's status, detail and fix, from the listener's and probes' answers."""
    if not heard.get("listening") and first.running:
        # Most likely the run's own rendezvous store; a deploy stops the run first.
        return (
            WARN,
            f"port {port} on node {first.name} is in use while run {first.running} runs "
            f"there (its rendezvous, most likely): not checked; after "
            f"{hints.command('stop')}, doctor checks it",
            None,
        )
    if not heard.get("listening"):
        return (
            FAIL,
            f"node {first.name} cannot listen on port {port} in its container: "
            f"{heard.get('error')} (a run still holding it?)",
            f"stop what holds it ({hints.command('stop')} stops the runs), "
            "or set torchrun.port to a free port",
        )
    failed = [(name, error) for name, ok, error in reached if not ok]
    if failed:
        names = ", ".join(name for name, _ in failed)
        who = f"node {names}" if len(failed) == 1 else f"nodes {names}"
        why = "; ".join(f"{name}: {error}" for name, error in failed)
        containers = (
            f"{who}'s container has" if len(failed) == 1 else f"the containers of {who} have"
        )
        return (
            FAIL,
            f"{who} cannot reach {where} on node {first.name} ({why})",
            f"let TCP port {port} through to node {first.name}'s container (its "
            f"firewall, the host's), check that {containers} a network route to "
            f"{address}, or set torchrun.address to an address of node {first.name} "
            "that every node reaches",
        )
    peers = heard.get("peers") or []
    if len(peers) < len(reached):
        return (
            FAIL,
            f"{len(reached) - len(peers)} of {len(reached)} nodes reached something at "
            f"{where} that is not node {first.name}'s container",
            f"set torchrun.address to node {first.name}'s container address",
        )
    return (
        PASS,
        f"node {first.name} listens on port {port}; all {len(reached)} nodes reach {where}",
        None,
    )


# --------------------------------------------------------------------------- agreement


_AGREE = (("python", "Python"), ("torch", "torch"), ("release", "release"))


def _agreement_check(doctor: Doctor, checkups: list[NodeCheckup]) -> None:
    """Warn when what must match across the nodes does not (as far as it was read)."""
    differs, same = [], []
    for key, label in _AGREE:
        values = {c.name: c.facts[key] for c in checkups if key in c.facts}
        if len(values) < 2:
            continue
        # Releases match by their files (the digest), whatever their ids.
        compared = {v.split(" (files ")[-1] if key == "release" else v for v in values.values()}
        if len(compared) > 1:
            listed = ", ".join(f"{name} {value or 'none yet'}" for name, value in values.items())
            differs.append(f"{label} differs: {listed}")
        else:
            value = next(iter(values.values()))
            if key == "release":
                ids = sorted({v.split(" (files ")[0] for v in values.values()})
                files = value.split(" (files ")[-1].rstrip(")")
                same.append(
                    f"the same release files ({files}: {', '.join(ids)})"
                    if value
                    else "no release yet"
                )
            else:
                same.append(value)
    if differs:
        doctor.add(
            Check(
                "nodes agree",
                WARN,
                "; ".join(differs)
                + f" (the same interpreter and torch on every node; {hints.command('deploy')} "
                "sends every node the same release)",
            )
        )
    elif same:
        doctor.add(Check("nodes agree", PASS, f"{', '.join(same)} on every node"))
    else:
        doctor.skip("nodes agree", "needs python on the nodes")
