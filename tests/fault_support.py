"""Fault attacks on a 2-node deploy: two real containers behind two test hosts, a
light 2-node torchrun job, and faults struck at moments picked by watching what the
deploy really does (a release folder being built, a run folder appearing), not by
sleeping.

    pair = make_pair(...)                      # module-scoped in the tests
    trial = Trial(pair)                         # an old run on both nodes, a new source
    trial.deploy(aim=BUILDING_ON_B, fault=kill_cli)
    outcome = trial.settle_and_classify()       # fault_state.classify
    trial.repair()                              # the next plain deploy must fix it

The job is a stand-in (torch.distributed over gloo, then idle): what is tested is the
deploy's stop/swap/launch on two nodes, not training, and it must cost the shared
test machine almost nothing while it runs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests import full_disk
from tests.fault_state import (
    WORKDIR,
    NodeState,
    Outcome,
    classify,
    node_state,
    release_ids,
    run_ids,
    running_runs,
    workdir_view,
)
from tests.host import netns, state
from tests.host.containers import Container
from tests.host.fixtures import build_config

DFLASHCTL = [sys.executable, "-m", "dflashctl"]
POLL_S = 0.005
BLOB_BYTES = 4 << 20

# torchrun's rank: joins the job's process group (a node whose partner never comes
# waits here, as a real rank would), says so, then idles until stopped.
STANDIN = """\
import datetime, os, signal, sys, time
RANK = []
SLOW = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_stop_rank0")
def stop(*_):
    # A real rank 0 writes a checkpoint on SIGTERM: its torchrun (and the job's store)
    # outlives the other nodes' stop by that long.
    if RANK == [0] and os.path.exists(SLOW):
        time.sleep(float(open(SLOW).read() or 0))
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
RANK.append(dist.get_rank())
print("[rank%d]: joined run %s" % (dist.get_rank(), os.environ.get("DFLASH_RUN_ID")), flush=True)
while True:
    time.sleep(1)
"""


@dataclass
class Node:
    name: str
    container: Container
    host: object  # tests.host.sshd.SshServer

    def state(self) -> NodeState:
        return node_state(self.name, self.container)

    @property
    def view(self) -> Path:
        return workdir_view(self.container)


@dataclass
class Pair:
    config: Path
    source: Path
    nodes: list[Node]
    env: dict[str, str]
    network: object = None
    _trials: int = 0

    @property
    def a(self) -> Node:
        return self.nodes[0]

    @property
    def b(self) -> Node:
        return self.nodes[1]

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*DFLASHCTL, args[0], "-c", str(self.config), *args[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            env=self.env,
        )

    def new_source(self) -> None:
        """A change in the trainer's source: the next deploy builds a new release. A few
        MB that do not compress, so that the build lasts long enough to be struck."""
        self._trials += 1
        (self.source / "trial.txt").write_text(f"trial {self._trials} {time.time_ns()}\n")
        (self.source / "blob.bin").write_bytes(os.urandom(BLOB_BYTES))

    def states(self) -> list[NodeState]:
        return [node.state() for node in self.nodes]


def make_pair(tmp: Path, host_a, host_b, known_hosts: Path, *, small_disk_on_b: bool) -> Pair:
    """Two containers (200 on host_a, 201 on host_b) on a network of their own, and a
    dflash.yaml running the stand-in as 2 nodes. With `small_disk_on_b`, gpu-b's
    workdir is a 64 MiB tmpfs mounted inside its container (tests.full_disk fills it)."""
    network = netns.Network(2)
    containers = []
    for vmid, host, endpoint in ((200, host_a, network[0]), (201, host_b, network[1])):
        state.create_container(host.state_dir, vmid, None, netns=endpoint.state_entry())
        container = Container(host.state_dir, vmid, network=endpoint)
        container.start()
        containers.append(container)
    if small_disk_on_b:
        mount_tmpfs_inside(containers[1], WORKDIR, size_mb=64)
    source = tmp / "src"
    source.mkdir()
    (source / "train.py").write_text(STANDIN)
    config = build_config(host_a, vmid=None, trainer_source=source)
    config["host"] = {
        "user": host_a.user,
        "identity_file": str(host_a.identity_file),
        "known_hosts": str(known_hosts),
        "connect_timeout_s": 5,
        "keepalive_s": 2,
    }
    del config["proxmox"]
    config["trainer"].update(entry="train.py", args=[], env={"OMP_NUM_THREADS": "1"})
    config["run"]["stop_grace_s"] = 3
    config["torchrun"] = {"nproc_per_node": 1, "port": 29400}
    config["nodes"] = [
        {
            "name": name,
            "host": {"address": host.address, "port": host.port},
            "proxmox": {"node": host.node},
            "container": {"vmid": ct.vmid},
        }
        for name, host, ct in (("gpu-a", host_a, containers[0]), ("gpu-b", host_b, containers[1]))
    ]
    path = tmp / "dflash.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp / "cache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    nodes = [Node("gpu-a", containers[0], host_a), Node("gpu-b", containers[1], host_b)]
    return Pair(config=path, source=source, nodes=nodes, env=env, network=network)


def close_pair(pair: Pair) -> None:
    for node in pair.nodes:
        if not node.host.is_up:
            node.host.restart()
        node.container.destroy()
    pair.network.close()


def mount_tmpfs_inside(container: Container, path: str, size_mb: int) -> None:
    """A tmpfs on `path` in the container's own mount namespace (so the host's view of
    /root stays as it was, and the container's workdir is a small filesystem)."""
    program = (
        "import ctypes, os, sys; os.makedirs(sys.argv[1], exist_ok=True); "
        "libc = ctypes.CDLL(None, use_errno=True); "
        "r = libc.mount(b'tmpfs', sys.argv[1].encode(), b'tmpfs', 0, sys.argv[2].encode()); "
        "sys.exit(0 if r == 0 else os.strerror(ctypes.get_errno()))"
    )
    done = subprocess.run(
        ["nsenter", "-t", str(container.init_pid()), "-m", "--", sys.executable, "-S", "-c",
         program, path, f"size={size_mb}m,mode=0755"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"cannot mount a tmpfs on {path} in {container.vmid}: {done.stderr}")


# --------------------------------------------------------------------------- waiting


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, pause: float = 0.2
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(pause)


def joined(pair: Pair, run_id: str) -> bool:
    """Both ranks of `run_id` passed the job's rendezvous (its train.log says so)."""
    for rank, node in enumerate(pair.nodes):
        log = node.view / "runs" / run_id / "train.log"
        try:
            if f"[rank{rank}]: joined run {run_id}" not in log.read_text(errors="replace"):
                return False
        except OSError:
            return False
    return True


def settle(pair: Pair, timeout: float = 240) -> list[NodeState]:
    """Wait until no node has a deploy in flight (its workdir lock free) and what runs
    has stayed the same for 2 s; then each node's state."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        states = pair.states()
        seen = [(s.busy, frozenset(s.running), s.current) for s in states]
        if seen != last:
            last, since = seen, time.monotonic()
        elif not any(s.busy for s in states) and time.monotonic() - since >= 2:
            return states
        if time.monotonic() > deadline:
            return states  # classified as it is: a deploy that never ends is a finding too
        time.sleep(0.25)


def deploy_ok(pair: Pair) -> str:
    """A plain deploy succeeds and both nodes run its one run (the same id), with one
    complete `current`: the run id."""
    done = pair.cli("deploy", "--detach", "--json")
    if done.returncode != 0:
        raise AssertionError(f"deploy failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    answer = json.loads(done.stdout)
    run_id = answer.get("run_id") or answer.get("result", {}).get("run_id")
    # Running on both (its ranks may still be starting: joining is not the deploy's).
    wait_until(lambda: running_everywhere(pair, run_id), 60, f"run {run_id} on both nodes")
    states = pair.states()
    assert all(s.running == {run_id} for s in states), [s.describe() for s in states]
    assert len({s.current for s in states}) == 1 and all(s.complete for s in states), [
        s.describe() for s in states
    ]
    return run_id


# --------------------------------------------------------------------------- aiming


@dataclass
class Moment:
    """When to strike: `hit(pair, before)` turns true at that moment of the deploy."""

    name: str
    hit: Callable[[Pair, dict], bool]


def _new_runs(node: Node, before: dict) -> set[str]:
    return run_ids(node.container) - before["runs"][node.name]


def _building(node: Node) -> Callable[[Pair, dict], bool]:
    def hit(pair: Pair, before: dict) -> bool:
        releases = node.view / "releases"
        return releases.is_dir() and any(p.name.endswith(".partial") for p in releases.iterdir())

    return hit


def _built_everywhere(pair: Pair, before: dict) -> bool:
    """Every node has the new release, complete, and none has swapped `current` or
    started the new run yet (a run folder made ahead of the launch may be there)."""
    if not all(release_ids(n.container) - before["releases"][n.name] for n in pair.nodes):
        return False
    for node, old in zip(pair.nodes, before["currents"], strict=True):
        try:
            current = os.path.basename(os.readlink(node.view / "current").rstrip("/"))
        except OSError:
            current = None
        if current != old:
            return False
    return not any(_launched(n)(pair, before) for n in pair.nodes)


def _launching(node: Node) -> Callable[[Pair, dict], bool]:
    return lambda pair, before: bool(_new_runs(node, before))


def _launched(node: Node) -> Callable[[Pair, dict], bool]:
    def hit(pair: Pair, before: dict) -> bool:
        return any((node.view / "runs" / r / "pid").exists() for r in _new_runs(node, before))

    return hit


def moments(pair: Pair) -> dict[str, Moment]:
    a, b = pair.a, pair.b
    return {
        m.name: m
        for m in (
            Moment("building on gpu-b", _building(b)),
            Moment("built on both, before any launch", _built_everywhere),
            Moment("launch began on gpu-a", _launching(a)),
            Moment("launch began on gpu-b", _launching(b)),
            Moment("launched on gpu-a", _launched(a)),
        )
    }


# --------------------------------------------------------------------------- a trial


@dataclass
class Trial:
    """One faulted deploy: the CLI as a subprocess of its own session."""

    pair: Pair
    before: list[NodeState] = field(default_factory=list)
    marks: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    out: str = ""
    err: str = ""
    hit: bool = False

    def start(self, *args: str) -> None:
        pair = self.pair
        self.before = pair.states()
        self.marks = {
            "runs": {n.name: run_ids(n.container) for n in pair.nodes},
            "releases": {n.name: release_ids(n.container) for n in pair.nodes},
            "currents": [s.current for s in self.before],
        }
        self.logs = Path(pair.config).parent / f"cli-{time.time_ns()}"
        self._out, self._err = open(f"{self.logs}.out", "w+"), open(f"{self.logs}.err", "w+")
        self.proc = subprocess.Popen(
            [*DFLASHCTL, args[0], "-c", str(pair.config), *args[1:]],
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=self._err,
            env=pair.env,
            start_new_session=True,  # its own group: Ctrl-C reaches it and its children
        )

    def aim(self, moment: Moment, timeout: float = 240) -> bool:
        """Poll until `moment` (True) or the CLI ended first (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if moment.hit(self.pair, self.marks):
                    self.hit = True
                    return True
            except OSError:
                pass  # a folder renamed under us: look again
            if self.proc.poll() is not None:
                return False
            time.sleep(POLL_S)
        return False

    def random_moment(self, longest_s: float) -> bool:
        time.sleep(random.uniform(0, longest_s))
        self.hit = self.proc.poll() is None
        return self.hit

    def sigkill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    def ctrl_c(self) -> None:
        """As a terminal's Ctrl-C: SIGINT to the CLI's whole process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    def finish(self, timeout: float = 300) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
            self._err.write(f"\n[harness] the CLI did not end within {timeout} s; killed\n")
        for stream in (self._out, self._err):
            stream.flush()
            stream.seek(0)
        self.out, self.err = self._out.read(), self._err.read()
        self._out.close()
        self._err.close()
        return code

    def outcome(self) -> Outcome:
        return classify(self.before, settle(self.pair))


def strike(pair: Pair, moment: Moment | None, fault: Callable[[Trial], None], *, random_s: float = 0.0,
           args: tuple[str, ...] = ("deploy", "--detach", "--json")) -> tuple[Trial, int, Outcome]:  # fmt: skip
    """One faulted deploy: start it, wait for `moment` (or a random moment within
    `random_s`), apply `fault`, let it end; (the trial, its exit code, the outcome)."""
    pair.new_source()
    trial = Trial(pair)
    trial.start(*args)
    if moment is not None:
        trial.aim(moment)
    elif random_s:
        trial.random_moment(random_s)
    if trial.proc.poll() is None:
        fault(trial)
    code = trial.finish()
    return trial, code, trial.outcome()


def new_runs_left(trial: Trial) -> str:
    """What each node's new run folders hold (their files, the end of their logs): for
    a failed trial's message, since the containers go with the test."""
    lines = []
    for node in trial.pair.nodes:
        try:
            fresh = sorted(_new_runs(node, trial.marks))
        except OSError as exc:
            lines.append(f"{node.name}: unreadable ({exc})")
            continue
        for run in fresh:
            folder = node.view / "runs" / run
            try:
                names = sorted(p.name for p in folder.iterdir())
            except OSError:
                names = []
            lines.append(f"{node.name}: run {run}: {', '.join(names)}")
            for name in names:
                if name.endswith((".log", ".json")) or name in ("status", "exit", "pid"):
                    try:
                        text = (folder / name).read_text(errors="replace")[-1500:]
                    except OSError:
                        continue
                    lines.append(f"  --- {name}:\n{text}")
    return "\n".join(lines) or "no new run folder on any node"


def old_runs_everywhere(pair: Pair) -> str:
    """The trial's starting point: one run on both nodes (a fresh deploy if not)."""
    states = pair.states()
    running = {frozenset(s.running) for s in states}
    if len(running) == 1 and len(states[0].running) == 1:
        (run_id,) = states[0].running
        return run_id
    pair.new_source()
    return deploy_ok(pair)


def running_everywhere(pair: Pair, run_id: str) -> bool:
    return all(running_runs(n.container) == {run_id} for n in pair.nodes)


def fill_workdir(node: Node) -> int:
    return full_disk.fill(node.view)


def free_workdir(node: Node) -> None:
    full_disk.empty(node.view)
