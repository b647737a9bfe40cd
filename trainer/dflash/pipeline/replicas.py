"""Data-parallel drafter replicas in one process: gradients averaged every step.

Each drafter thread hands in one flat fp32 buffer (its gradients plus its loss and
metrics); all replicas meet at a barrier, each sums the buffers in rank order on its
own device and divides by the replica count. Every replica does the same arithmetic
in the same order, so the results are bitwise identical and the replicas stay equal.
On GPUs the sum reads the other replicas' buffers with peer copies (PyTorch orders
cross-device copies against both devices' current streams); on CPU it is plain
shared memory.

The barrier's action also samples the "stop after this step" request (SIGTERM), so
every replica takes the same decision at the same step.

The barrier is our own rather than ``threading.Barrier``: aborting a
``threading.Barrier`` to free a replica whose peer died also breaks it for a replica
that was already released but not yet scheduled, which then loses its step. Here a
released replica always returns; only one still waiting for a peer gives up on a stop.

Replicas on distinct GPUs of one process sum with one in-process NCCL all-reduce
(``torch.cuda.nccl``, issued by the last thread to arrive, on every device's current
stream) instead of peer copies: a ring does not grow with the number of replicas, the
peer copies read every other replica's whole buffer. ``DistributedAverager`` does the
same across processes (torchrun), through torch.distributed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from dflash.pipeline.supervisor import POLL_S, Stopped, Supervisor


class StopAwareBarrier:
    """N parties meet; ``action`` runs once per meeting, in the last arriving thread."""

    def __init__(self, parties: int, supervisor: Supervisor, action: Callable[[], None]) -> None:
        self._parties = parties
        self._supervisor = supervisor
        self._action = action
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0

    def wait(self) -> None:
        """Returns once all parties arrived; raises ``Stopped`` if the run stops first."""
        with self._cond:
            generation = self._generation
            self._arrived += 1
            if self._arrived == self._parties:
                self._action()
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
                return
            while self._generation == generation:
                if self._supervisor.stop.is_set():
                    self._arrived -= 1
                    raise Stopped()
                self._cond.wait(timeout=POLL_S)


class StepTimer:
    """Time of the gradient averaging per step: CUDA events on a GPU (the work is
    asynchronous), the wall clock on CPU. Read after the step's results reached the host."""

    def __init__(self) -> None:
        self.total_ms = 0.0
        self.count = 0
        self._events = None
        self._started = 0.0

    def start(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._events[0].record(torch.cuda.current_stream(device))
        else:
            self._events = None
            self._started = time.perf_counter()

    def stop(self, device: torch.device) -> None:
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(device))
        else:
            self.total_ms += 1000 * (time.perf_counter() - self._started)
            self.count += 1

    def collect(self) -> None:
        """Call once the stream passed the stop event (after a .tolist() of the step)."""
        if self._events is not None:
            self.total_ms += self._events[0].elapsed_time(self._events[1])
            self.count += 1
            self._events = None

    def take_mean_ms(self) -> float | None:
        mean = self.total_ms / self.count if self.count else None
        self.total_ms, self.count = 0.0, 0
        return mean


class GradientAverager:
    """Replicas in one process (drafter threads): see the module doc."""

    def __init__(
        self,
        num_replicas: int,
        supervisor: Supervisor,
        stop_requested: Callable[[], bool],
        comm_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.num_replicas = num_replicas
        self.comm_dtype = comm_dtype
        self._slots: list[torch.Tensor | None] = [None] * num_replicas
        self._split = 0  # elements of the slots that are gradients (the rest: loss, metrics)
        self._stop_requested = stop_requested
        self.stop_after_step = False
        self.timer = StepTimer()
        self.payload_bytes = 0
        self.method = "none" if num_replicas == 1 else "peer copies"
        self._barrier = StopAwareBarrier(num_replicas, supervisor, self._on_all_arrived)

    def _sample_stop(self) -> None:
        self.stop_after_step = bool(self._stop_requested())

    def _on_all_arrived(self) -> None:
        self._sample_stop()
        if self._uses_nccl():
            self._nccl_sum()

    def _uses_nccl(self) -> bool:
        slots = self._slots
        if self.num_replicas < 2 or any(s is None or s.device.type != "cuda" for s in slots):
            return False
        if len({s.device.index for s in slots}) != len(slots):
            return False
        import torch.cuda.nccl as nccl

        return nccl.is_available(slots)

    def _nccl_sum(self) -> None:
        """In-place sum of every slot, on every device (one NCCL all-reduce per part)."""
        import torch.cuda.nccl as nccl

        slots, split = self._slots, self._split
        if self.comm_dtype == torch.float32 or split == 0:
            nccl.all_reduce(slots)
            return
        grads = [s[:split].to(self.comm_dtype) for s in slots]
        nccl.all_reduce(grads)
        for slot, summed in zip(slots, grads, strict=True):
            slot[:split].copy_(summed)
        nccl.all_reduce([s[split:] for s in slots])  # loss and metrics stay fp32

    def all_reduce_mean(self, rank: int, flat: torch.Tensor, split: int = 0) -> torch.Tensor:
        """The mean of every replica's ``flat``, on ``flat``'s device; blocks until all arrive.
        ``split``: how many leading elements are gradients (sent in ``comm_dtype``).

        Raises ``Stopped`` when the run stops before every replica arrived."""
        if self.num_replicas == 1:
            self._sample_stop()
            return flat
        self._slots[rank] = flat
        self._split = split
        self._barrier.wait()
        if self._uses_nccl():  # the last thread to arrive summed every slot in place
            self.method = "nccl (in process)"
            flat /= self.num_replicas
            return flat
        total = self._slots[0].to(flat.device, copy=True)
        for other in self._slots[1:]:
            total += other.to(flat.device)
        total /= self.num_replicas
        # Nobody replaces its slot until everyone has read every slot.
        self._barrier.wait()
        return total

    def average(self, replica, extras: list[torch.Tensor]) -> list[float]:
        """Average ``replica``'s gradients with the other replicas' into its optimizer's
        master gradients; returns the mean of ``extras`` (loss, metrics) as floats."""
        optimizer = replica.optimizer
        if self.num_replicas == 1:
            optimizer.set_master_grads(optimizer.model_grads())
            self._sample_stop()
            return flatten([], extras).tolist()
        timed = replica.rank == 0  # one timer, read by the lead replica's log lines
        if timed:
            self.timer.start(replica.device)
        grads = optimizer.model_grads()
        flat = flatten(grads, extras)
        split = sum(g.numel() for g in grads)
        self.payload_bytes = split * torch.tensor([], dtype=self.comm_dtype).element_size()
        flat = self.all_reduce_mean(replica.rank, flat, split)
        used = master_grads_as_views(optimizer.masters, flat)
        if timed:
            self.timer.stop(replica.device)
        stats = flat[used:].tolist()
        if timed:
            self.timer.collect()
        return stats


class DistributedAverager:
    """One replica per process (torchrun): bucketed torch.distributed all-reduce.

    Under ``reduce-overhead`` the backward is one recorded CUDA graph that hands back all
    gradients at once when it ends, so per-parameter hooks (DDP's way to start a bucket
    while the backward still runs) would all fire together at its end: there is nothing
    to overlap with inside the backward. So the gradients are averaged after the backward,
    in buckets: bucket k+1 is packed (cast, copied) on the compute stream while bucket k
    is on the wire on NCCL's stream. The rest of the overlap comes from the pipeline: the
    target loop keeps running its forwards on its own stream while the drafter's stream
    waits for the all-reduce. The last, small bucket carries the loss, the metrics and
    the "stop after this step" vote (SIGTERM seen on any rank), always in fp32.
    """

    def __init__(
        self,
        world_size: int,
        stop_requested: Callable[[], bool],
        comm_dtype: torch.dtype = torch.float32,
        bucket_mb: float = 256.0,
        explain: Callable[[BaseException], BaseException] | None = None,
    ) -> None:
        self.world_size = world_size
        self._explain = explain  # Coordinator.explain: a peer's death, named by the peer
        self.comm_dtype = comm_dtype
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._stop_requested = stop_requested
        self.stop_after_step = False
        self.timer = StepTimer()
        self.payload_bytes = 0
        self.method = f"torch.distributed, {world_size} ranks"
        self._buckets: list[tuple[int, int]] | None = None  # [first, last) parameter indices

    def _plan(self, grads: list[torch.Tensor]) -> list[tuple[int, int]]:
        size = torch.tensor([], dtype=self.comm_dtype).element_size()
        buckets, first, filled = [], 0, 0
        for i, grad in enumerate(grads):
            filled += grad.numel() * size
            if filled >= self.bucket_bytes:
                buckets.append((first, i + 1))
                first, filled = i + 1, 0
        if first < len(grads):
            buckets.append((first, len(grads)))
        return buckets

    def average(self, replica, extras: list[torch.Tensor]) -> list[float]:
        try:
            return self._average(replica, extras)
        except Exception as exc:
            if self._explain is None:
                raise
            cause = self._explain(exc)
            if cause is exc:
                raise
            raise cause from exc

    def _average(self, replica, extras: list[torch.Tensor]) -> list[float]:
        import torch.distributed as dist

        optimizer = replica.optimizer
        device = replica.device
        vote = torch.tensor([1.0 if self._stop_requested() else 0.0], device=device)
        tail = torch.cat([flatten([], extras), vote])
        if self.world_size == 1:  # a one-rank all-reduce is the identity: skip the copies
            optimizer.set_master_grads(optimizer.model_grads())
            stats = tail.tolist()
            self.stop_after_step = stats[-1] > 0
            return stats[:-1]
        self.timer.start(device)
        grads = optimizer.model_grads()
        if self._buckets is None:
            self._buckets = self._plan(grads)
            self.payload_bytes = (
                sum(g.numel() for g in grads)
                * torch.tensor([], dtype=self.comm_dtype).element_size()
            )
        pending = []
        for first, last in self._buckets:
            packed = torch.cat(
                [g.detach().reshape(-1).to(self.comm_dtype) for g in grads[first:last]]
            )
            pending.append((first, last, packed, dist.all_reduce(packed, async_op=True)))
        tail_work = dist.all_reduce(tail, async_op=True)
        masters = optimizer.masters
        for first, last, packed, work in pending:
            work.wait()
            summed = packed.float() if packed.dtype != torch.float32 else packed
            summed /= self.world_size
            master_grads_as_views(masters[first:last], summed)
        tail_work.wait()
        tail /= self.world_size
        self.timer.stop(device)
        stats = tail.tolist()
        self.timer.collect()
        self.stop_after_step = stats[-1] > 0
        return stats[:-1]


def master_grads_as_views(masters: Sequence[torch.Tensor], flat: torch.Tensor) -> int:
    """Each master's gradient becomes a view of its slice of the averaged fp32 buffer (no
    copy of 4 GB per step: the buffer is this step's alone); returns the elements used."""
    offset = 0
    for master in masters:
        n = master.numel()
        master.grad = flat[offset : offset + n].view_as(master)
        offset += n
    return offset


def flatten(tensors: Sequence[torch.Tensor], extra: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    parts = [t.detach().reshape(-1).float() for t in tensors]
    parts += [t.detach().reshape(-1).float() for t in extra]
    return torch.cat(parts)


def unflatten_into(flat: torch.Tensor, targets: Sequence[torch.Tensor]) -> int:
    """Copy consecutive slices of ``flat`` into ``targets``; returns the number of elements used."""
    offset = 0
    for target in targets:
        n = target.numel()
        target.copy_(flat[offset : offset + n].view_as(target))
        offset += n
    return offset
