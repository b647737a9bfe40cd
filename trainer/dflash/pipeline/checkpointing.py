"""Atomic training checkpoints, written in the background, and resume.

A checkpoint is a folder ``<output_dir>/checkpoints/step-000120/`` holding
``training_state.pt`` (trainable weights, optimizer with fp32 masters, scheduler,
step, RNG states, resolved config), ``train_config.json`` (the resolved config alone,
for tools that must not load the whole state) and ``drafter/`` (the drafter export).
It is written under a temporary name and renamed into place, and ``latest`` (a text
file naming the folder) is replaced atomically afterwards: a crash mid-write never
leaves a checkpoint that looks complete.

Training waits only for the snapshot: ``CheckpointWriter`` copies every tensor of the
state into host buffers (pinned for GPU tensors, kept and reused between checkpoints,
so a 1B-parameter drafter with its Adam state is one ~15 GB device-to-host copy) and
writes them on a background thread. One write at a time: a request while one is in
flight either waits for it or is skipped with a log line, and the host buffers are
never refilled while a write still reads them.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "training_state.pt"
CONFIG_FILE = "train_config.json"
LATEST_FILE = "latest"
STEP_FOLDER = re.compile(r"step-(\d+)")  # hidden temporaries start with "."
FORMAT_VERSION = 1


@dataclass
class TrainingState:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict
    config: dict
    rng: dict
    nonfinite_count: int = 0

    @classmethod
    def from_dict(cls, data: dict) -> TrainingState:
        """The inverse of to_dict (a loaded file, or what rank 0 sent)."""
        return cls(
            step=int(data["step"]),
            model=data["model"],
            optimizer=data["optimizer"],
            config=data["config"],
            rng=data["rng"],
            nonfinite_count=int(data.get("nonfinite_count", 0)),
        )

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
    return {name: p.detach().cpu().clone() for name, p in live_trainable_state(model).items()}


def live_trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights themselves, wherever they live (for `CheckpointWriter` to copy)."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


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
        (temp / CONFIG_FILE).write_text(json.dumps(state.config, indent=1, default=str) + "\n")
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


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def saved_config(folder: Path) -> dict | None:
    """The resolved run config saved with a step folder (None for a bare drafter folder)."""
    folder = Path(folder)
    if (folder / CONFIG_FILE).is_file():
        return json.loads((folder / CONFIG_FILE).read_text())
    if (folder / STATE_FILE).is_file():  # older checkpoints: the config is inside the state
        return torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False, mmap=True)[
            "config"
        ]
    return None


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names; if it names none that is complete (a run killed
    while it moved the pointer, a folder removed by hand), the newest complete one on
    disk: a step folder is renamed into place only once its state file is written."""
    pointer = output_dir / "checkpoints" / LATEST_FILE
    if pointer.is_file():
        name = pointer.read_text().strip()
        folder = pointer.parent / name
        if name and (folder / STATE_FILE).is_file():
            return folder
    return newest_complete(output_dir / "checkpoints")


def newest_complete(checkpoints: Path) -> Path | None:
    """The complete ``step-NNNNNN`` folder with the highest step, or None."""
    best: tuple[int, Path] | None = None
    if not checkpoints.is_dir():
        return None
    for folder in checkpoints.iterdir():
        match = STEP_FOLDER.fullmatch(folder.name)
        if match and (folder / STATE_FILE).is_file():
            step = int(match.group(1))
            if best is None or step > best[0]:
                best = (step, folder)
    return best[1] if best else None


def load_checkpoint(folder: Path) -> TrainingState:
    data = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{folder}: unsupported checkpoint format {data.get('format_version')!r}")
    return TrainingState.from_dict(data)


# ---------------------------------------------------------------- background writes


class HostCopy:
    """Copies nested containers of tensors into host buffers that are kept and reused.

    GPU tensors go to pinned buffers with non-blocking copies and one synchronisation at
    the end; CPU tensors are cloned into plain buffers. Buffers are matched by their
    place in the structure, so the same state shape reuses them checkpoint after
    checkpoint (pinned allocation is the slow part of the first one).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def copy(self, obj: Any) -> Any:
        devices: set[torch.device] = set()
        for tensor in _tensors(obj):
            if tensor.is_cuda:
                devices.add(tensor.device)
        for device in devices:  # every kernel that writes the state has finished
            torch.cuda.synchronize(device)
        out = self._copy(obj, ())
        for device in devices:  # every copy has landed
            torch.cuda.synchronize(device)
        return out

    def _copy(self, obj: Any, key: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj.detach(), key)
        if isinstance(obj, dict):
            return {k: self._copy(v, (*key, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, (*key, i)) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return obj

    def _copy_tensor(self, tensor: torch.Tensor, key: tuple) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(
                tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda
            )
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        return buffer


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


@dataclass
class CheckpointStats:
    step: int
    path: Path | None = None
    bytes_written: int = 0
    stall_s: float = 0.0  # the caller blocked: waiting for a previous write + the host copy
    durable_s: float = 0.0  # from the request until the folder is renamed in place, fsynced

    def line(self) -> str:
        return (
            f"checkpoint stats: step {self.step} | {self.bytes_written / 1e9:.2f} GB written | "
            f"stall {self.stall_s:.2f} s | durable after {self.durable_s:.1f} s"
        )


# export(model_weights, folder): writes the drafter export from the snapshot's weights.
Exporter = Callable[[dict[str, torch.Tensor], Path], None]


class CheckpointWriter:
    """One writer per run (on one rank): ``save_async`` snapshots and returns, ``wait``
    blocks until the write in flight is durable.

    ``collect()`` returns a ``TrainingState`` whose tensors may be the live ones (on any
    device): the writer copies them before it returns, so training may go on at once.
    """

    def __init__(self, output_dir: Path, log: Callable[[str], None] = print) -> None:
        self.output_dir = Path(output_dir)
        self.log = log
        self.stats: list[CheckpointStats] = []
        self._host = HostCopy()
        self._lock = threading.Lock()  # one snapshot + write at a time
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last: Path | None = None
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """Half-written folders of a run that was killed mid-write (one writer per run dir)."""
        folder = self.output_dir / "checkpoints"
        if folder.is_dir():
            for path in folder.glob(".step-*"):
                if ".tmp-" in path.name or ".old-" in path.name:
                    shutil.rmtree(path, ignore_errors=True)

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save_async(
        self,
        step: int,
        collect: Callable[[], TrainingState],
        export: Exporter | None = None,
        *,
        if_busy: str = "wait",
    ) -> bool:
        """Snapshot the state and start writing it; False when skipped (``if_busy="skip"``
        while a write is in flight)."""
        requested = time.perf_counter()
        with self._lock:
            if if_busy == "skip" and self.busy():
                self.log(
                    f"checkpoint at step {step} skipped: the previous one is still being written"
                )
                return False
            self._join()  # the write in flight is done: the host buffers are free again
            self._error = None  # a failed earlier write was logged; this one starts clean
            state = collect()
            snapshot = TrainingState(**{**state.__dict__, **self._host.copy(_tensor_fields(state))})
            stats = CheckpointStats(step=step, stall_s=time.perf_counter() - requested)
            self._thread = threading.Thread(
                target=self._write,
                args=(snapshot, export, stats, requested),
                name=f"checkpoint-{step}",
                daemon=True,
            )
            self._thread.start()
        return True

    def save(
        self, step: int, collect: Callable[[], TrainingState], export: Exporter | None = None
    ) -> Path:
        """Synchronously: wait for any write in flight, then write this one."""
        self.save_async(step, collect, export, if_busy="wait")
        path = self.wait()
        assert path is not None
        return path

    def wait(self) -> Path | None:
        """Block until no write is in flight; the last checkpoint written, or raise its error."""
        self._join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._last

    def _join(self) -> None:
        thread = self._thread
        if thread is not None:
            thread.join()

    def _write(self, state: TrainingState, export, stats: CheckpointStats, requested: float):
        try:
            exporter = (lambda folder: export(state.model, folder)) if export else None
            path = save_checkpoint(self.output_dir, state, exporter)
        except BaseException as exc:  # kept for wait(); training goes on meanwhile
            self._error = exc
            where = checkpoint_dir(self.output_dir, state.step)
            self.log(
                f"checkpoint at step {state.step} failed: {type(exc).__name__}: {exc} "
                f"(writing {where}; {free_space_text(self.output_dir)})"
            )
            return
        stats.path = path
        stats.bytes_written = folder_bytes(path)
        stats.durable_s = time.perf_counter() - requested
        self.stats.append(stats)
        self._last = path
        self.log(f"checkpoint: {path} ({stats.durable_s:.1f} s)")
        self.log(stats.line())


def free_space_text(folder: Path) -> str:
    """`12.3 MiB free of 2.0 GiB on /data`: a failed write is often a full disk, which
    torch.save reports only as "unexpected pos N vs M" (its zip writer)."""
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError as exc:
        return f"free space unknown: {exc.strerror}"
    return f"{_size_text(usage.free)} free of {_size_text(usage.total)} at {probe}"


def _size_text(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}" if unit != "B" else f"{count} B"
        size /= 1024
    return f"{size:.1f} TiB"


def _tensor_fields(state: TrainingState) -> dict:
    """The fields of a state that hold tensors (copied to the host; the rest is small)."""
    return {"model": state.model, "optimizer": state.optimizer, "rng": state.rng}
