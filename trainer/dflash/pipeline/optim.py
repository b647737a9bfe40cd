"""AdamW over fp32 master weights, cosine learning rate with linear warm-up, clipping.

The published recipe trains bf16 weights with an fp32 master copy: the optimizer
updates the fp32 copy and the result is copied back into the model in place (CUDA
graphs captured the parameters' addresses, so they must never be replaced). For fp32
models the master copy is the parameter itself.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable

import torch

from dflash.pipeline.train_config import OptimSection


class CosineWithWarmup:
    """lr(step) = peak * warm-up ramp, then cosine down to ``min_lr_ratio * peak``."""

    def __init__(
        self, peak_lr: float, total_steps: int, warmup_ratio: float, min_lr_ratio: float
    ) -> None:
        self.peak_lr = peak_lr
        self.total_steps = max(1, total_steps)
        self.warmup_ratio = warmup_ratio
        self.warmup_steps = int(math.ceil(warmup_ratio * self.total_steps))
        self.min_lr_ratio = min_lr_ratio
        self.last_step = 0  # optimizer steps taken so far

    def resize(self, total_steps: int) -> None:
        """A new step count mid-run (train.budget_minutes): the cosine ends with it; a
        warm-up still under way ramps to the new count's length (never back into one)."""
        self.total_steps = max(1, total_steps)
        if self.last_step < self.warmup_steps:
            wanted = int(math.ceil(self.warmup_ratio * self.total_steps))
            self.warmup_steps = max(self.last_step + 1, wanted)

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step number ``step`` (0-based)."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

    def state_dict(self) -> dict:
        return {
            "last_step": self.last_step,
            "peak_lr": self.peak_lr,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "min_lr_ratio": self.min_lr_ratio,
        }

    def load_state_dict(self, state: dict) -> None:
        self.last_step = int(state["last_step"])


class MasterWeightAdamW:
    def __init__(
        self, params: Iterable[torch.nn.Parameter], cfg: OptimSection, total_steps: int
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the drafter has no trainable parameters")
        self.uses_master = any(p.dtype != torch.float32 for p in self.params)
        if self.uses_master:
            self.masters = [p.detach().float().clone() for p in self.params]
        else:
            self.masters = self.params
        on_cuda = self.params[0].device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            self.masters,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            fused=on_cuda or None,
            foreach=None if on_cuda else True,
        )
        self.scheduler = CosineWithWarmup(cfg.lr, total_steps, cfg.warmup_ratio, cfg.min_lr_ratio)
        self.grad_clip = cfg.grad_clip

    @property
    def lr(self) -> float:
        return self.scheduler.lr_at(self.scheduler.last_step)

    def model_grads(self) -> list[torch.Tensor]:
        """The model's gradients (zeros where a parameter got none)."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def set_master_grads(self, grads: list[torch.Tensor]) -> None:
        for master, grad in zip(self.masters, grads, strict=False):
            master.grad = grad.float() if grad.dtype != torch.float32 else grad

    def master_grads_from_flat(self, flat: torch.Tensor) -> int:
        offset = 0
        for master in self.masters:
            n = master.numel()
            master.grad = flat[offset : offset + n].view_as(master).clone()
            offset += n
        return offset

    def step(self) -> float:
        """Clip, update the masters, copy them into the model; returns the gradient norm."""
        norm = torch.nn.utils.clip_grad_norm_(
            self.masters, self.grad_clip if self.grad_clip > 0 else float("inf"), foreach=True
        )
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        self.optimizer.step()
        self.scheduler.last_step += 1
        if self.uses_master:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], self.masters)
        self.zero_grad()
        return float(norm)

    def skip_step(self) -> None:
        """A step without an update (non-finite loss): drop the gradients, keep the schedule."""
        self.zero_grad()
        self.scheduler.last_step += 1

    def zero_grad(self) -> None:
        # set_to_none: accumulating into cudagraph-owned .grad tensors is an error.
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    # -- state

    def state_dict(self, live: bool = False) -> dict:
        """``live``: the master tensors themselves, not CPU copies (the checkpoint writer
        copies them into pinned memory without a synchronous device-to-host copy)."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.uses_master:
            state["masters"] = [
                m.detach() if live else m.detach().cpu().clone() for m in self.masters
            ]
        return state

    def load_state_dict(self, state: dict) -> None:
        # A deep copy: load_state_dict keeps tensors that already have the right dtype
        # and device, so replicas loading one saved state would share (and doubly
        # update) the same Adam moments.
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        with torch.no_grad():
            if self.uses_master and "masters" in state:
                for master, saved in zip(self.masters, state["masters"], strict=False):
                    master.copy_(saved)
            if self.uses_master:
                torch._foreach_copy_([p.data for p in self.params], self.masters)

    def snapshot(self) -> dict:
        """Everything a warm-up step changes, to put back afterwards."""
        return {
            "params": [p.detach().clone() for p in self.params],
            "masters": [m.detach().clone() for m in self.masters] if self.uses_master else None,
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "last_step": self.scheduler.last_step,
        }

    def restore(self, snap: dict) -> None:
        with torch.no_grad():
            for p, saved in zip(self.params, snap["params"], strict=False):
                p.copy_(saved)  # in place: captured graphs hold these addresses
            if snap["masters"] is not None:
                for m, saved in zip(self.masters, snap["masters"], strict=False):
                    m.copy_(saved)
        self.optimizer.load_state_dict(snap["optimizer"])
        self.scheduler.last_step = snap["last_step"]
        self.zero_grad()
