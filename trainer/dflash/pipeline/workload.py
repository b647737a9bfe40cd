"""What the pipeline needs from a model and its data, and the deterministic data order.

The pipeline (threads, warm-up, replicas, checkpoints) only talks to a ``Workload``;
``dflash/dflash_workload.py`` is the real one, kept outside this generic package; the
tests bring a tiny stand-in. Nothing in dflash/pipeline/ imports the model, objective,
masks, target, data or evaluation: they come in through a Workload.

Data order is a pure function of (seed, step, shard): the batch drafter ``shard``
trains on at global ``step`` never depends on what ran before, so a resumed run sees
exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import torch


class EvalReport(Protocol):
    """What an evaluation returns: its log line and the numbers metrics.jsonl keeps."""

    def format_line(self) -> str: ...

    def metrics(self) -> dict[str, Any]: ...


@dataclass
class Batch:
    """One drafter's share of one step, padded to static shapes (CPU tensors from the prefetcher)."""

    step: int
    shard: int
    input_ids: torch.Tensor  # [B, S] long
    attention_mask: torch.Tensor  # [B, S] long
    loss_mask: torch.Tensor  # [B, S] long
    anchors: torch.Tensor  # [B, A] long
    anchor_valid: torch.Tensor  # [B, A] bool

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = (
                value.to(device, non_blocking=non_blocking)
                if isinstance(value, torch.Tensor)
                else value
            )
        return Batch(**moved)

    def pin_memory(self) -> Batch:
        pinned = {}
        for f in fields(self):
            value = getattr(self, f.name)
            pinned[f.name] = value.pin_memory() if isinstance(value, torch.Tensor) else value
        return Batch(**pinned)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class DrafterInputs:
    """What one drafter step consumes, already on the drafter's device."""

    step: int
    shard: int
    context: torch.Tensor  # [B, S, k*H] hidden states of the selected target layers
    input_ids: torch.Tensor
    anchors: torch.Tensor
    anchor_valid: torch.Tensor
    loss_mask: torch.Tensor
    ready: Any = None  # a CUDA event recorded after the inputs were written (other stream)
    num_tokens: int = 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.context, self.input_ids, self.anchors, self.anchor_valid, self.loss_mask]


class Workload:
    """Base class: deterministic sample order; subclasses supply model and data."""

    seed: int = 0
    batch_size: int = 1

    def __init__(self, cfg: Any) -> None:
        """The shape of the data every workload shares, from the resolved TrainConfig."""
        self.cfg = cfg
        self.seed = cfg.seed
        self.batch_size = cfg.data.batch_size
        self.seq_len = cfg.data.seq_len
        self.num_anchors = cfg.data.num_anchors
        self._targets: dict[torch.device, torch.nn.Module] = {}  # the run's one target cache

    # -- data (prefetcher thread; CPU only)

    def num_samples(self) -> int:
        raise NotImplementedError

    def make_batch(
        self, sample_ids: list[int], generator: torch.Generator, step: int, shard: int
    ) -> Batch:
        raise NotImplementedError

    def sample_ids(self, step: int, shard: int, num_shards: int) -> list[int]:
        """Sample indices of drafter ``shard`` at global ``step``: epochs are seeded permutations."""
        per_step = self.batch_size * num_shards
        total = self.num_samples()
        first = step * per_step + shard * self.batch_size
        ids = []
        for position in range(first, first + self.batch_size):
            epoch, offset = divmod(position, total)
            ids.append(int(self._permutation(epoch)[offset]))
        return ids

    def _permutation(self, epoch: int) -> torch.Tensor:
        cache = self.__dict__.setdefault("_perm_cache", {})
        if epoch not in cache:
            cache.clear()
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            cache[epoch] = torch.randperm(self.num_samples(), generator=gen)
        return cache[epoch]

    def batch_for(self, step: int, shard: int, num_shards: int) -> Batch:
        gen = torch.Generator().manual_seed((self.seed * 7919 + step) * 131 + shard)
        return self.make_batch(self.sample_ids(step, shard, num_shards), gen, step, shard)

    # -- target (target loops; no grad)

    def target_for(self, device: torch.device | str) -> torch.nn.Module:
        """The target on ``device``: built on first use (before the threads start), then
        the same module for the target loop, the drafters' embedding/head and evaluation."""
        device = torch.device(device)
        if device not in self._targets:
            self._targets[device] = self.build_target(device)
        return self._targets[device]

    def build_target(self, device: torch.device) -> torch.nn.Module:
        raise NotImplementedError

    def target_context(self, target: torch.nn.Module, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def target_compiled(self, device: torch.device) -> bool:
        """Does the target forward on `device` compile? Then `warm_target` runs it once
        with the production shapes under the capture lock, before training starts."""
        return False

    def warm_target(self, target: torch.nn.Module, device: torch.device) -> None:
        pass

    def target_forward_text(self, target: torch.nn.Module, device: torch.device) -> str:
        """How the target forward runs on `device`, for the run's log ("" to say nothing)."""
        return ""

    # -- drafter (drafter threads)

    def build_drafter(self, device: torch.device) -> torch.nn.Module:
        raise NotImplementedError

    def loss_module(self, drafter: torch.nn.Module) -> torch.nn.Module:
        """A module whose forward(context, input_ids, anchors, anchor_valid, loss_mask) returns
        (loss, metrics: dict of tensors); this is what gets compiled."""
        raise NotImplementedError

    def example_inputs(self, device: torch.device) -> DrafterInputs:
        """Inputs with the exact production shapes and dtypes, for warm-up (made on the CPU)."""
        raise NotImplementedError

    def tau_estimate(self, metrics: dict[str, float]) -> float:
        return 1.0

    def serving_estimate(self, metrics: dict[str, float]) -> tuple[float, float] | None:
        """(tokens, blocks) of the step's anchors as serving would walk them, from the
        step's own metrics (free); the step line's tau~ is their ratio over the window."""
        return None

    def serving_tau(self, drafter: torch.nn.Module, inputs: DrafterInputs) -> float | None:
        """tau as serving would measure it on this batch's text (None: not measured);
        asked for on some logged steps only (a time budget), so it may cost forwards."""
        return None

    def flops_per_batch(self) -> float:
        """Target forward plus drafter forward+backward FLOPs for one drafter's batch."""
        return 0.0

    @property
    def walk_set_label(self) -> str:
        """What the tau walk walks where not the batch ("held-out samples"; "": the batch)."""
        return ""

    @property
    def walks_to_cover(self) -> int:
        """How many walks take every row of that set once."""
        return 1

    @property
    def walks_at_the_end(self) -> bool:
        """Does the last step walk too, whatever the walk budget (an estimate of the
        end-of-run eval, which costs far more than the walk)?"""
        return False

    def prepare_walk(self) -> str | None:
        """Make the walk's rows where they need the target (before the threads start);
        a line for the run's log, None where nothing ran."""
        return None

    def target_flops_per_batch(self) -> float:
        """The target forward's share of `flops_per_batch`."""
        return 0.0

    # -- end of run

    def evaluate(self, drafter: torch.nn.Module) -> EvalReport | None:
        return None

    def evaluate_checkpoint(self, folder: Path) -> EvalReport | None:
        """The evaluation of the drafter saved in checkpoint ``folder``, read back from disk;
        None where the workload cannot (the run then evaluates the in-memory drafter)."""
        return None

    def save_drafter(self, drafter: torch.nn.Module, folder: Path) -> None:
        pass

    def export_weights(self, weights: dict[str, torch.Tensor], folder: Path) -> None:
        """Write the drafter export from a snapshot of its trainable weights (host tensors,
        named as in ``named_parameters``); runs on the checkpoint writer's thread."""

    def describe(self) -> list[str]:
        return []
