"""Atomic training checkpoints and resume.

A checkpoint is a folder ``<output_dir>/checkpoints/step-000120/`` holding
``training_state.pt`` (trainable weights, optimizer with fp32 masters, scheduler,
step, RNG states, resolved config) and ``drafter/`` (the drafter export). It is
written under a temporary name and renamed into place, and ``latest`` (a text file
naming the folder) is replaced atomically afterwards: a crash mid-write never leaves
a checkpoint that looks complete.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "training_state.pt"
LATEST_FILE = "latest"
FORMAT_VERSION = 1


@dataclass
class TrainingState:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict
    config: dict
    rng: dict
    nonfinite_count: int = 0

    def to_dict(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "model": self.model,
            "optimizer": self.optimizer,
            "config": self.config,
            "rng": self.rng,
            "nonfinite_count": self.nonfinite_count,
        }


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights the run trains (the frozen target embedding and LM head are not saved)."""
    return {
        name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad
    }


def load_trainable_state(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = sorted(set(k for k, p in params.items() if p.requires_grad) - set(saved))
    unexpected = sorted(set(saved) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not fit the drafter: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    with torch.no_grad():
        for name, value in saved.items():
            params[name].copy_(value)  # in place: compiled graphs hold the addresses


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / "checkpoints" / f"step-{step:06d}"


def save_checkpoint(
    output_dir: Path,
    state: TrainingState,
    export_drafter: Callable[[Path], None] | None = None,
) -> Path:
    final = checkpoint_dir(output_dir, state.step)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    if temp.exists():
        shutil.rmtree(temp)
    temp.mkdir()
    try:
        torch.save(state.to_dict(), temp / STATE_FILE)
        if export_drafter is not None:
            export_drafter(temp / "drafter")
        _fsync_tree(temp)
        if final.exists():  # the same step saved again (e.g. SIGTERM right after a periodic save)
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(temp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    latest_tmp = final.parent / f".{LATEST_FILE}.tmp-{os.getpid()}"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, final.parent / LATEST_FILE)
    return final


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def latest_checkpoint(output_dir: Path) -> Path | None:
    pointer = output_dir / "checkpoints" / LATEST_FILE
    if not pointer.is_file():
        return None
    folder = pointer.parent / pointer.read_text().strip()
    return folder if (folder / STATE_FILE).is_file() else None


def load_checkpoint(folder: Path) -> TrainingState:
    data = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{folder}: unsupported checkpoint format {data.get('format_version')!r}")
    return TrainingState(
        step=int(data["step"]),
        model=data["model"],
        optimizer=data["optimizer"],
        config=data["config"],
        rng=data["rng"],
        nonfinite_count=int(data.get("nonfinite_count", 0)),
    )
