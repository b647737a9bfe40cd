"""Under torchrun, rank 0's resume decision is every rank's.

Only rank 0 writes checkpoints, and storage need not be shared between hosts: a rank on
another host has no checkpoint folder (or a path it cannot read), whatever its own
``DFLASH_RESUME_FROM`` / ``--resume-from`` / ``--resume`` says. So rank 0 decides and
checks (before the rendezvous: a misfit fails in seconds), then tells every rank
through the store:

- rank 0 refused its checkpoint (a config error): every rank hears it and exits 2;
- rank 0 starts at step 0: so does every rank;
- rank 0 resumes from a folder: a rank that can read the same folder (same path, same
  file: see ``fingerprint``) loads it itself; when any rank cannot, rank 0 sends the
  state to every rank (state_broadcast.py: one collective, the others take it too).

A rank whose own setting names another checkpoint follows rank 0 and says so.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.pipeline import checkpointing as ckpt
from dflash.pipeline.distributed import Coordinator, PeerFailure
from dflash.pipeline.logging import RunLog
from dflash.pipeline.resuming import RESUMED_RUN_ENV, StartOver, load_for_resume, resume_line
from dflash.pipeline.state_broadcast import broadcast_state
from dflash.pipeline.train_config import TrainConfig, TrainConfigError

TAIL_BYTES = 1 << 20


@dataclass
class LeadChoice:
    """What rank 0 resumes from, decided and checked before the rendezvous."""

    folder: Path | None = None
    state: ckpt.TrainingState | None = None
    error: str | None = None  # a config error, already printed on rank 0
    note: str | None = None  # a line for rank 0's log (--resume found nothing)


def choose_on_lead(cfg: TrainConfig, resume: bool, folder: Path | None) -> LeadChoice:
    """Rank 0: ``folder`` (--resume-from / $DFLASH_RESUME_FROM), or with ``resume`` the
    latest checkpoint in output_dir, checked by load_for_resume; or nothing."""
    if resume:
        output_dir = cfg.resolved_output_dir()
        folder = ckpt.latest_checkpoint(output_dir)
        if folder is None:
            return LeadChoice(note=f"resume: no checkpoint under {output_dir}; starting at step 0")
    if folder is None:
        return LeadChoice()
    try:
        return LeadChoice(folder=folder, state=load_for_resume(folder, cfg))
    except StartOver as over:
        return LeadChoice(note=str(over))
    except TrainConfigError as exc:
        return LeadChoice(folder=folder, error=str(exc))


def fingerprint(folder: Path) -> str:
    """Names a checkpoint's content without reading all of it: torch.save writes a zip
    whose central directory, at the end, holds the CRC-32 of every record; with the size
    that tells the same file from another one at the same path (another run's folder on
    another host) in one 1 MiB read."""
    path = Path(folder) / ckpt.STATE_FILE
    size = path.stat().st_size
    with open(path, "rb") as handle:
        handle.seek(max(0, size - TAIL_BYTES))
        tail = handle.read()
    return hashlib.sha256(f"{size}:".encode() + tail).hexdigest()


def _readable(folder: str, expected: str) -> bool:
    try:
        return fingerprint(Path(folder)) == expected
    except OSError:  # absent here, or unreadable: rank 0 sends it
        return False


def agree_on_resume(
    coordinator: Coordinator,
    log: RunLog,
    cfg: TrainConfig,
    *,
    choice: LeadChoice | None,
    own_folder: Path | None,
) -> tuple[ckpt.TrainingState | None, Path | None]:
    """Every rank: rank 0's state and folder (None, None: step 0). ``choice`` is rank 0's
    (None elsewhere); ``own_folder`` is this rank's own setting, followed only on rank 0.
    Raises TrainConfigError on every rank when rank 0 refused its checkpoint, once every
    rank has heard it."""
    if coordinator.rank == 0:
        assert choice is not None
        decision = {
            "error": choice.error,
            "folder": os.path.abspath(choice.folder) if choice.folder and choice.state else None,
            "step": choice.state.step if choice.state else 0,
            "run": os.environ.get(RESUMED_RUN_ENV) or "",
            "fingerprint": fingerprint(choice.folder) if choice.state else "",
        }
        coordinator.publish("resume", json.dumps(decision))
        if choice.note:
            log.line(choice.note)
    else:
        decision = json.loads(coordinator.read("resume"))
    if decision["error"] is not None:
        _leave_together(coordinator)
        raise TrainConfigError(
            decision["error"]
            if coordinator.rank == 0
            else f"rank 0 refused its checkpoint, so no rank resumes: {decision['error']}"
        )
    folder = decision["folder"]
    if coordinator.rank != 0 and own_folder is not None:
        own = os.path.abspath(own_folder)
        if own != folder:
            follows = f"resumes from {folder}" if folder else "starts at step 0"
            log.line(f"resume: rank 0 {follows}; this rank's own {own} is not used")
    if folder is None:
        return None, None

    readable = coordinator.rank == 0 or _readable(folder, decision["fingerprint"])
    if coordinator.vote("resume-transfer", 0 if readable else 1) == 0:
        state = choice.state if coordinator.rank == 0 else ckpt.load_checkpoint(Path(folder))
        source = "" if coordinator.rank == 0 else " (rank 0's choice, read here)"
    else:  # some rank cannot read it: one broadcast from rank 0, every rank takes it
        state = broadcast_state(choice.state if coordinator.rank == 0 else None, _wire(cfg))
        source = "" if coordinator.rank == 0 else " (from rank 0)"
    run = decision["run"] or "(by hand)"
    log.line(resume_line(Path(folder), state, run=run) + source)
    return state, Path(folder)


def _wire(cfg: TrainConfig) -> torch.device:
    """Where the backend moves tensors: the rank's GPU for NCCL (set as current by the
    entry point), the CPU for gloo."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device(cfg.runtime.drafter_devices[0])
    return torch.device("cpu")


def _leave_together(coordinator: Coordinator) -> None:
    """Rank 0 refused to resume: every rank has read why before rank 0 (the store's host
    without torchrun) leaves; a peer gone meanwhile changes nothing, we exit 2 anyway."""
    try:
        coordinator.finish()
    except PeerFailure:
        coordinator.close_after_failure()
