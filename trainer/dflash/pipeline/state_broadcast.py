"""Rank 0's training state on every rank, through torch.distributed, tensor by tensor.

Used when a rank cannot read the checkpoint rank 0 resumes from (storage is not shared
between hosts). The structure (config, python RNG state, step, scalars) is small and
goes as one pickled object; the tensors then go one at a time as raw bytes, so the
memory stays flat: no pickled copy of a ~15 GB state (what ``broadcast_object_list``
of the whole state would build on every rank), and with NCCL only one tensor at a
time sits on the GPU. Raw bytes make the copy exact for every dtype on both backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dflash.pipeline import checkpointing as ckpt


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's place in the pickled structure; its bytes follow separately."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a TensorSpec (the tensors appended in order)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return TensorSpec(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_strip(v, tensors) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, TensorSpec):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_fill(v, tensors) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _nbytes(spec: TensorSpec) -> int:
    count = 1
    for size in spec.shape:
        count *= size
    return count * torch.empty((), dtype=spec.dtype).element_size()


def broadcast_state(state: ckpt.TrainingState | None, device: torch.device) -> ckpt.TrainingState:
    """Collective: rank 0 passes its state, every other rank None and gets rank 0's (on the
    CPU, as ``load_checkpoint`` returns it). ``device``: where the backend moves tensors
    (the rank's GPU for NCCL, the CPU for gloo)."""
    import torch.distributed as dist

    lead = dist.get_rank() == 0
    tensors: list[torch.Tensor] = []
    box = [_strip(state.to_dict(), tensors) if lead else None]
    dist.broadcast_object_list(box, src=0, device=device)
    skeleton = box[0]
    specs: list[TensorSpec] = []
    _collect_specs(skeleton, specs)
    received: list[torch.Tensor] = []
    for spec in sorted(specs, key=lambda s: s.index):
        nbytes = _nbytes(spec)
        if lead:
            wire = tensors[spec.index].detach().reshape(-1).view(torch.uint8).to(device)
        else:
            wire = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if nbytes:
            dist.broadcast(wire, src=0)
        if not lead:
            received.append(wire.cpu().view(spec.dtype).reshape(spec.shape))
    if lead:
        return state
    return ckpt.TrainingState.from_dict(_fill(skeleton, received))


def _collect_specs(obj: Any, specs: list[TensorSpec]) -> None:
    if isinstance(obj, TensorSpec):
        specs.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_specs(v, specs)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_specs(v, specs)
