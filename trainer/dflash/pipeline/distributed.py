"""The world this process trains in: a plain run is rank 0 of a world of one; under
torchrun one process per GPU, with ranks, the store, fail-fast and barriers.

Every decision that differs between one process and many is taken here, by ``World``;
the rest of the pipeline calls it the same way in both (a barrier of one passes at
once, a vote of one is its own value, a broadcast from rank 0 keeps what it has).

    torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        train_dflash_pipeline.py --config configs/qwen3-8b.yaml

Each process runs the usual threads (prefetcher, target loop, one drafter) on its own
GPU(s); the drafters average gradients through torch.distributed (NCCL on GPUs, gloo on
CPU). Everything a collective cannot do well goes through the rendezvous store instead:

- fail-fast: every rank writes a heartbeat each second and watches the others'. A rank
  whose thread fails posts the cause (rank, host, thread, device, exception) before it
  exits; a rank that vanishes (SIGKILL, OOM killer, a lost host) stops beating. Either
  way the others stop within seconds, naming it, instead of hanging in a collective
  until NCCL's watchdog fires (10 minutes by default; ``runtime.dist_timeout_s`` here is
  only the backstop).
- barriers with no time limit but a dead-peer check: the end of the warm-up (compile
  times differ per rank), a checkpoint being written by rank 0, the end of the run.
  A collective would time out there; a store barrier just waits for live peers.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from dflash.pipeline.config_errors import TrainConfigError
from dflash.pipeline.logging import RunLog
from dflash.pipeline.replicas import DistributedAverager, GradientAverager
from dflash.pipeline.supervisor import POLL_S, Supervisor

HEARTBEAT_S = 1.0
LEAVE_WAIT_S = 10.0  # rank 0 (the store's host without torchrun) waits this long for the others
# The start of the line World.started prints: dflashctl's start gate (its default
# run.start_line) waits for it on every node.
STARTED_LINE = "rendezvous:"


class PeerFailure(RuntimeError):
    """Another rank failed or stopped answering; this rank stops too."""


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    host: str = ""
    under_torchrun: bool = False  # torchrun with one rank still runs the distributed path
    node_rank: int = 0  # torchrun's GROUP_RANK: which of the job's nodes this is
    num_nodes: int = 1
    node_name: str = (
        ""  # the node's name in dflash.yaml (DFLASH_NODE_NAME), when dflashctl launched it
    )

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or self.under_torchrun

    @property
    def is_lead(self) -> bool:
        return self.rank == 0

    @staticmethod
    def from_env(environ: dict | None = None) -> DistInfo:
        """torchrun's RANK/WORLD_SIZE/LOCAL_RANK; a plain ``python`` run is rank 0 of 1."""
        env = os.environ if environ is None else environ
        world = int(env.get("WORLD_SIZE", "1"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        return DistInfo(
            rank=int(env.get("RANK", "0")),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=local_world,
            host=socket.gethostname(),
            under_torchrun="TORCHELASTIC_RUN_ID" in env,
            node_rank=int(env.get("GROUP_RANK") or env.get("DFLASH_NODE_RANK") or "0"),
            num_nodes=int(env.get("GROUP_WORLD_SIZE") or env.get("DFLASH_NUM_NODES") or "1"),
            node_name=env.get("DFLASH_NODE_NAME", ""),
        )

    def node_text(self) -> str:
        """`node 1/2 (gpu-b)`: which node, for the crash detector's rank-to-node map."""
        name = f" ({self.node_name})" if self.node_name else ""
        return f"node {self.node_rank}/{self.num_nodes}{name}"

    def label(self) -> str:
        return f"rank {self.rank}/{self.world_size} on host {self.host} (pid {os.getpid()})"


def shift_devices(devices: list[str], info: DistInfo, device_count: int) -> list[str]:
    """The config names one process's GPUs (e.g. target cuda:0, drafter cuda:1); local rank
    r takes the r-th such group of the host's GPUs. With fewer GPUs than processes the
    groups wrap around (processes share a GPU: measurements on a one-GPU machine)."""
    indices = [int(d.split(":")[1]) for d in devices if d.startswith("cuda:")]
    if not indices or info.local_rank == 0:
        return list(devices)
    per_process = max(indices) + 1
    shifted = []
    for dev in devices:
        if dev.startswith("cuda:"):
            index = int(dev.split(":")[1]) + info.local_rank * per_process
            shifted.append(f"cuda:{index % max(1, device_count)}")
        else:
            shifted.append(dev)
    return shifted


class RankLog(RunLog):
    """Lines of ranks other than 0 carry torch's own ``[rankN]: `` prefix, so one
    combined torchrun log still says who wrote what (the crash detector reads it)."""

    def __init__(self, rank: int, stream=None) -> None:
        super().__init__(stream)
        self.prefix = f"[rank{rank}]: " if rank else ""

    def line(self, text: str) -> None:
        super().line(self.prefix + text)


class Coordinator:
    """The rendezvous store plus the process group; see the module doc."""

    def __init__(self, info: DistInfo, log: RunLog, *, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self.info = info
        self.log = log
        self.backend = backend
        store, rank, world = next(
            dist.rendezvous("env://", info.rank, info.world_size, timeout=timedelta(seconds=300))
        )
        # Keys of an earlier attempt (torchrun --max-restarts keeps its store) must not count.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._store = dist.PrefixStore(f"dflash/{attempt}", store)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        self._store.set(f"host/{rank}", info.host)
        self.peer_failure: str | None = None
        self._on_peer_failure: list[Callable[[str], None]] = []
        self._closing = threading.Event()
        self._monitor: threading.Thread | None = None
        self.peer_timeout_s = 15.0

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    # -- fail-fast

    def start_monitor(self, peer_timeout_s: float) -> None:
        self.peer_timeout_s = peer_timeout_s
        self._monitor = threading.Thread(target=self._watch, name="rank-monitor", daemon=True)
        self._monitor.start()

    def on_peer_failure(self, callback: Callable[[str], None]) -> None:
        self._on_peer_failure.append(callback)

    def post_failure(self, text: str) -> None:
        """Tell the other ranks why this one is going down (best effort: the store may be gone)."""
        try:
            self._store.set(f"failed/{self.rank}", f"{self.info.label()}: {text}")
        except Exception:  # noqa: BLE001 - we are failing already; the heartbeat covers it
            pass

    def _peer_host(self, rank: int) -> str:
        try:
            if self._store.check([f"host/{rank}"]):
                return self._store.get(f"host/{rank}").decode()
        except Exception:  # noqa: BLE001
            pass
        return "?"

    def _watch(self) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        last_seen = {r: (b"", time.monotonic()) for r in peers}
        beat = 0
        while not self._closing.is_set():
            try:
                beat += 1
                self._store.set(f"hb/{self.rank}", str(beat))
                for r in peers:
                    if self._store.check([f"failed/{r}"]):
                        text = self._store.get(f"failed/{r}").decode()
                        self._fail(f"rank {r} failed: {text}")
                        return
                    if self._store.check([f"done/{r}"]):
                        continue
                    value = self._store.get(f"hb/{r}") if self._store.check([f"hb/{r}"]) else b""
                    seen, since = last_seen[r]
                    now = time.monotonic()
                    if value != seen:
                        last_seen[r] = (value, now)
                    elif now - since > self.peer_timeout_s:
                        self._fail(
                            f"rank {r} on host {self._peer_host(r)} stopped answering: no "
                            f"heartbeat for {now - since:.0f} s (killed, out of memory, or its "
                            "host is gone)"
                        )
                        return
            except Exception as exc:  # noqa: BLE001 - the store's host is gone
                if self._closing.is_set():
                    return
                self._fail(
                    f"lost the rendezvous store ({type(exc).__name__}: {exc}); the rank or "
                    "agent hosting it (rank 0's host) is gone"
                )
                return
            self._closing.wait(HEARTBEAT_S)

    def _fail(self, text: str) -> None:
        if self.peer_failure is None:
            self.peer_failure = text
            for callback in self._on_peer_failure:
                callback(text)

    def explain(self, exc: BaseException) -> BaseException:
        """A collective failed here (gloo: "Connection reset by peer"; NCCL: an abort):
        usually because another rank died first. Name that rank's own cause if it posted
        one, or the rank the heartbeat finds silent (a killed rank posts nothing) within
        the heartbeat's own limit; otherwise the collective's error stands."""
        deadline = time.monotonic() + self.peer_timeout_s + 2 * HEARTBEAT_S
        peers = [r for r in range(self.world_size) if r != self.rank]
        while time.monotonic() < deadline:
            if self.peer_failure is not None:
                return PeerFailure(self.peer_failure)
            try:
                for r in peers:
                    if self._store.check([f"failed/{r}"]):
                        text = self._store.get(f"failed/{r}").decode()
                        return PeerFailure(f"rank {r} failed: {text}")
            except Exception:  # noqa: BLE001 - the store went away with its host
                break
            time.sleep(POLL_S)
        return exc

    def check_peers(self) -> None:
        if self.peer_failure is not None:
            raise PeerFailure(self.peer_failure)

    # -- store barriers

    def barrier(self, name: str, stop_check: Callable[[], None] | None = None) -> int:
        """Wait until every rank arrived at ``name``; no time limit, but gives up when a peer
        failed (PeerFailure) or ``stop_check`` raises. Returns the sum of ``add`` values
        (the ranks' votes: see ``vote``)."""
        return self.vote(name, 0, stop_check)

    def vote(self, name: str, value: int, stop_check: Callable[[], None] | None = None) -> int:
        """A barrier that also sums one integer per rank (e.g. "SIGTERM seen here")."""
        self._store.add(f"votes/{name}", value)
        self._store.add(f"arrived/{name}", 1)
        while self._store.add(f"arrived/{name}", 0) < self.world_size:
            self.check_peers()
            if stop_check is not None:
                stop_check()
            time.sleep(POLL_S)
        return int(self._store.add(f"votes/{name}", 0))

    def publish(self, key: str, value: str) -> None:
        self._store.set(f"data/{key}", value)

    def read(self, key: str, stop_check: Callable[[], None] | None = None) -> str:
        while not self._store.check([f"data/{key}"]):
            self.check_peers()
            if stop_check is not None:
                stop_check()
            time.sleep(POLL_S)
        return self._store.get(f"data/{key}").decode()

    # -- the end

    def finish(self) -> None:
        """Clean end: meet the others, stop watching, leave (rank 0 last: without torchrun's
        agent it hosts the store the others still talk to)."""
        self.barrier("finished")
        self._store.set(f"done/{self.rank}", "1")
        self._closing.set()
        if self._monitor is not None:
            self._monitor.join(timeout=2 * HEARTBEAT_S)
        self._store.add("left", 1)
        if self.rank == 0:
            deadline = time.monotonic() + LEAVE_WAIT_S
            while self._store.add("left", 0) < self.world_size and time.monotonic() < deadline:
                time.sleep(POLL_S)
        import torch.distributed as dist

        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - we are leaving anyway
            pass

    def close_after_failure(self) -> None:
        self._closing.set()


def backend_for(devices: list[str], choice: str = "auto") -> str:
    """NCCL on GPUs; gloo on CPU, or by choice on GPUs (NCCL refuses two ranks on one GPU:
    a one-GPU machine running two ranks)."""
    if choice != "auto":
        return choice
    return "nccl" if any(d.startswith("cuda") for d in devices) else "gloo"


def abort_collectives(timeout_s: float = 5.0) -> None:
    """After a failure: abort the process group so that a thread blocked on an NCCL kernel
    whose peer is gone is released (best effort, bounded: we exit right after)."""
    import torch.distributed as dist

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or not dist.is_initialized():
        return

    def quietly() -> None:
        try:
            abort()
        except Exception:  # noqa: BLE001 - a backend that cannot abort: we exit anyway
            pass

    worker = threading.Thread(target=quietly, name="abort-collectives", daemon=True)
    worker.start()
    worker.join(timeout_s)


class World:
    """This process's place in the job, made once from the environment.

    A plain ``python`` run is rank 0 of a world of one and joins nothing; under torchrun
    (one rank too) ``join`` opens the store and the process group. Alone, every call is
    what one process would do by itself, so callers never ask which world they are in.
    """

    def __init__(self, info: DistInfo | None = None) -> None:
        self.info = info or DistInfo()
        self.coordinator: Coordinator | None = None
        self._published: dict[str, str] = {}  # a world of one reads what it published
        self._peer_callbacks: list[Callable[[str], None]] = []

    @staticmethod
    def from_env(environ: dict | None = None) -> World:
        return World(DistInfo.from_env(environ))

    # -- who we are

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def size(self) -> int:
        return self.info.world_size

    @property
    def is_main(self) -> bool:
        """Rank 0: it logs the run's header and step lines, writes checkpoints, evaluates."""
        return self.info.is_lead

    def label(self) -> str:
        return self.info.label()

    def where(self) -> str:
        """`` (rank 1/2 on host h (pid p))`` for a line that must say which rank; alone,
        nothing (the log has one writer)."""
        return f" ({self.info.label()})" if self.info.enabled else ""

    def run_log(self, stream=None) -> RunLog:
        return RankLog(self.rank, stream) if self.info.enabled else RunLog(stream)

    # -- the devices

    def place(self, runtime: Any) -> None:
        """Under torchrun this process takes its local rank's share of the GPUs the config
        names (``shift_devices``) and makes its drafter's GPU current (NCCL's device, and no
        stray context on cuda:0); alone, the config's devices are this process's."""
        if not self.info.enabled:
            return
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for key in ("target_devices", "drafter_devices"):
            setattr(runtime, key, shift_devices(getattr(runtime, key), self.info, count))
        drafter = torch.device(runtime.drafter_devices[0])
        if drafter.type == "cuda":
            torch.cuda.set_device(drafter)

    def check_layout(self, runtime: Any) -> None:
        """One drafter per rank under torchrun; alone, one thread per drafter device."""
        if self.info.enabled and len(runtime.drafter_devices) != 1:
            raise TrainConfigError(
                f"runtime.drafter_devices: {runtime.drafter_devices} under torchrun; each "
                "process runs one drafter: start one process per GPU (torchrun "
                "--nproc-per-node N) with drafter_devices: [cuda:0]"
            )

    def describe(self, runtime: Any) -> list[str]:
        """The log's ``distributed:`` line (none alone)."""
        if self.coordinator is None:
            return []
        info = self.info
        return [
            f"distributed: {info.label()}, local rank {info.local_rank}/{info.local_world_size}, "
            f"{info.node_text()}, {self.coordinator.backend}, target on "
            f"{', '.join(runtime.target_devices)}, drafter on {runtime.drafter_devices[0]}"
        ]

    def wire_device(self, runtime: Any):
        """Where collectives move tensors: the rank's GPU for NCCL, else the CPU."""
        import torch

        if self.coordinator is not None and self.coordinator.backend == "nccl":
            return torch.device(runtime.drafter_devices[0])
        return torch.device("cpu")

    # -- joining and leaving

    def join(self, log: RunLog, runtime: Any) -> None:
        """Meet the other ranks (the rendezvous) and start watching them; alone, nothing."""
        if not self.info.enabled or self.coordinator is not None:
            return
        self.coordinator = Coordinator(
            self.info,
            log,
            backend=backend_for(runtime.drafter_devices, runtime.dist_backend),
            timeout_s=runtime.dist_timeout_s,
        )
        for callback in self._peer_callbacks:
            self.coordinator.on_peer_failure(callback)
        self.coordinator.start_monitor(runtime.peer_timeout_s)

    def started(self, log: RunLog) -> None:
        """Every rank is past the rendezvous: after a barrier, local rank 0 of each node
        says so in its node's log (alone: that none was needed). `dflashctl deploy
        --detach` waits for this line on every node before it says the run started."""
        if self.coordinator is None:
            log.line(f"{STARTED_LINE} none needed (one process)")
            return
        self.barrier("started")
        if self.info.local_rank == 0:
            log.line(f"{STARTED_LINE} every rank joined ({self.size} ranks)")

    def finish(self) -> None:
        """Clean end: every rank leaves together (PeerFailure when one is gone)."""
        if self.coordinator is not None:
            self.coordinator.finish()

    def leave_after_failure(self, text: str | None = None) -> None:
        """This rank is going down: tell the others why (``text``), stop watching them and
        abort the collectives so that no thread stays blocked on a peer that is gone."""
        if self.coordinator is None:
            return
        if text is not None:
            self.coordinator.post_failure(text)
        self.coordinator.close_after_failure()
        abort_collectives()

    def close(self) -> None:
        """Stop watching the others (a clean end has already; idempotent)."""
        if self.coordinator is not None:
            self.coordinator.close_after_failure()

    # -- meeting the others

    def barrier(self, name: str, stop_check: Callable[[], None] | None = None) -> None:
        self.vote(name, 0, stop_check)

    def vote(self, name: str, value: int, stop_check: Callable[[], None] | None = None) -> int:
        """The sum over the ranks of ``value`` once every rank arrived (see Coordinator.vote)."""
        if self.coordinator is None:
            return value
        return self.coordinator.vote(name, value, stop_check)

    def publish(self, key: str, value: str) -> None:
        """Rank 0 tells every rank (through the store)."""
        self._published[key] = value
        if self.coordinator is not None:
            self.coordinator.publish(key, value)

    def read(self, key: str) -> str:
        if self.coordinator is None or key in self._published:
            return self._published[key]
        return self.coordinator.read(key)

    def broadcast_state(self, state: Any, runtime: Any) -> Any:
        """Rank 0's training state on every rank (state_broadcast.py); alone, its own."""
        if self.size == 1:
            return state
        from dflash.pipeline.state_broadcast import broadcast_state

        return broadcast_state(state, self.wire_device(runtime))

    def broadcast_from_main(self, tensors: list) -> None:
        """Every rank takes rank 0's values of ``tensors`` (in place)."""
        if self.size == 1:
            return
        import torch.distributed as dist

        for tensor in tensors:
            dist.broadcast(tensor, src=0)

    # -- failures

    def check_peers(self) -> None:
        if self.coordinator is not None:
            self.coordinator.check_peers()

    def explain(self, exc: BaseException) -> BaseException:
        """A collective's failure, named by the rank that caused it (alone: itself)."""
        return exc if self.coordinator is None else self.coordinator.explain(exc)

    def connect(self, supervisor: Supervisor) -> None:
        """A thread's failure here is posted for the other ranks (rank, host, thread, device,
        exception); a failure or silence there stops this rank's threads."""

        def post(name: str, exc: BaseException) -> None:
            if isinstance(exc, PeerFailure) or self.coordinator is None:
                return  # a consequence: the root cause is already posted by its rank
            device = supervisor.devices.get(name)
            on = f" on {device}" if device else ""
            self.coordinator.post_failure(f"{name}{on} failed: {type(exc).__name__}: {exc}")

        def stop_here(text: str) -> None:
            supervisor.record_failure("peers", PeerFailure(f"{self.label()}: {text}"))

        supervisor.on_failure(post)
        self._peer_callbacks.append(stop_here)
        if self.coordinator is not None:
            self.coordinator.on_peer_failure(stop_here)

    def averager(
        self,
        num_drafters: int,
        supervisor: Supervisor,
        stop_requested: Callable[[], bool],
        comm_dtype: Any,
        bucket_mb: float,
    ):
        """The gradient averaging of this world: the drafter threads of one process, or one
        drafter per rank through torch.distributed."""
        if self.coordinator is None:
            return GradientAverager(num_drafters, supervisor, stop_requested, comm_dtype)
        return DistributedAverager(self.size, stop_requested, comm_dtype, bucket_mb, self.explain)

    def stop_cause_elsewhere(self) -> str:
        """Why the steps stopped short when no signal reached this process."""
        return "a SIGTERM to another rank" if self.size > 1 else "a stop request"
