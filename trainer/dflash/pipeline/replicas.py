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
"""

from __future__ import annotations

import threading
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


class GradientAverager:
    def __init__(
        self, num_replicas: int, supervisor: Supervisor, stop_requested: Callable[[], bool]
    ) -> None:
        self.num_replicas = num_replicas
        self._slots: list[torch.Tensor | None] = [None] * num_replicas
        self._stop_requested = stop_requested
        self.stop_after_step = False
        self._barrier = StopAwareBarrier(num_replicas, supervisor, self._sample_stop)

    def _sample_stop(self) -> None:
        self.stop_after_step = bool(self._stop_requested())

    def all_reduce_mean(self, rank: int, flat: torch.Tensor) -> torch.Tensor:
        """The mean of every replica's ``flat``, on ``flat``'s device; blocks until all arrive.

        Raises ``Stopped`` when the run stops before every replica arrived."""
        if self.num_replicas == 1:
            self._sample_stop()
            return flat
        self._slots[rank] = flat
        self._barrier.wait()
        total = self._slots[0].to(flat.device, copy=True)
        for other in self._slots[1:]:
            total += other.to(flat.device)
        total /= self.num_replicas
        # Nobody replaces its slot until everyone has read every slot.
        self._barrier.wait()
        return total


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
