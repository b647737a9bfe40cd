"""Where a run continues from: the checkpoint choice, its checks, and every rank's share.

A run continues from ``--resume-from PATH``, from ``$DFLASH_RESUME_FROM`` (dflashctl sets
it to the replaced run's latest complete checkpoint folder, and ``DFLASH_RESUMED_RUN`` to
that run's id), or with ``--resume`` from the latest checkpoint in its own output_dir.
It writes into its own output_dir, leaving the old one as it was.

Rank 0 (alone: the only rank) decides and checks everything that can make the
checkpoint unusable before the slow set-up (building the target, making data; under
torchrun before the rendezvous), so a misfit fails within seconds. Only rank 0 writes
checkpoints and storage need not be shared between hosts, so rank 0's choice is every
rank's, whatever a rank's own setting says, and it travels through the world:

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

from dflash.pipeline import checkpointing as ckpt
from dflash.pipeline.distributed import PeerFailure, World
from dflash.pipeline.logging import RunLog
from dflash.pipeline.train_config import TrainConfig, TrainConfigError

RESUME_ENV = "DFLASH_RESUME_FROM"
RESUMED_RUN_ENV = "DFLASH_RESUMED_RUN"
# "1": the checkpoint is the end of a run that finished. Such a run is continued only
# when there are steps left (train.steps raised); otherwise this is a new training.
RESUMED_FINISHED_ENV = "DFLASH_RESUMED_FINISHED"

# Keys that decide the shape of the trained weights: another value cannot load them.
SHAPING_KEYS = (
    "target.preset",
    "target.path",
    "drafter.num_layers",
    "drafter.block_size",
    "drafter.intermediate_size",
)

FRESH_HINT = "deploy with --fresh to start at step 0"
TAIL_BYTES = 1 << 20


class StartOver(Exception):
    """The checkpoint ends a finished run with no steps left: train anew from step 0.
    Its message is the line for the log."""


def resume_folder(cli_value: str | None) -> Path | None:
    """The checkpoint to continue from: --resume-from, else $DFLASH_RESUME_FROM (an
    empty value means none, as a `{resume_from}` placeholder with nothing to resume)."""
    value = cli_value if cli_value is not None else os.environ.get(RESUME_ENV)
    return Path(value) if value else None


def _lookup(tree: dict, dotted: str):
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def load_for_resume(folder: Path, cfg: TrainConfig) -> ckpt.TrainingState:
    """Load and check the checkpoint; a TrainConfigError (exit 2) names what does not fit.
    StartOver: it ends a finished run and train.steps leaves nothing to train from it."""
    if not (folder / ckpt.STATE_FILE).is_file():
        raise TrainConfigError(
            f"cannot resume: {folder} is not a complete checkpoint (no {ckpt.STATE_FILE}); "
            f"{FRESH_HINT}"
        )
    try:
        state = ckpt.load_checkpoint(folder)
    except Exception as exc:  # a damaged or foreign file: say which, never half-resume
        raise TrainConfigError(
            f"cannot resume from {folder}: {type(exc).__name__}: {exc}; {FRESH_HINT}"
        ) from None
    now = cfg.to_dict()
    for key in SHAPING_KEYS:
        old, new = _lookup(state.config, key), _lookup(now, key)
        if old != new:
            raise TrainConfigError(
                f"the checkpoint {folder} (step {state.step}) was trained with {key}={old!r}, "
                f"the config now says {new!r}: its weights do not fit; set {key} back to "
                f"{old!r} to continue, or {FRESH_HINT}"
            )
    if state.step >= cfg.train.steps and os.environ.get(RESUMED_FINISHED_ENV) == "1":
        run = os.environ.get(RESUMED_RUN_ENV) or "the replaced run"
        raise StartOver(
            f"resume: run {run} finished at step {state.step} and train.steps is "
            f"{cfg.train.steps}: starting a new training at step 0 (raise train.steps to "
            f"continue it from {folder})"
        )
    if state.step >= cfg.train.steps:
        raise TrainConfigError(
            f"the checkpoint {folder} is at step {state.step}, and train.steps is "
            f"{cfg.train.steps}: nothing left to train; raise train.steps to continue, "
            f"or {FRESH_HINT}"
        )
    return state


def resume_line(folder: Path, state: ckpt.TrainingState, run: str | None = None) -> str:
    """``run``: the resumed run's id (default: $DFLASH_RESUMED_RUN; under torchrun rank 0's)."""
    run = run or os.environ.get(RESUMED_RUN_ENV) or "(by hand)"
    return f"resuming run {run} at step {state.step} from {folder}"


@dataclass
class Choice:
    """What rank 0 resumes from, decided and checked before the slow set-up. Other ranks
    hold an empty one: they take rank 0's (``agree``)."""

    folder: Path | None = None
    state: ckpt.TrainingState | None = None
    error: str | None = None  # a config error, printed at once by ``choose``'s caller
    note: str | None = None  # a line for rank 0's log (--resume found nothing, StartOver)
    own_folder: Path | None = None  # this rank's own setting (followed only on rank 0)


def choose(world: World, cfg: TrainConfig, resume: bool, cli_folder: str | None) -> Choice:
    """Rank 0: ``--resume-from`` / $DFLASH_RESUME_FROM, or with ``resume`` the latest
    checkpoint in output_dir, checked by load_for_resume; or nothing."""
    folder = None if resume else resume_folder(cli_folder)
    if not world.is_main:
        return Choice(own_folder=folder)
    if resume:
        output_dir = cfg.resolved_output_dir()
        folder = ckpt.latest_checkpoint(output_dir)
        if folder is None:
            return Choice(note=f"resume: no checkpoint under {output_dir}; starting at step 0")
    if folder is None:
        return Choice()
    try:
        return Choice(folder=folder, state=load_for_resume(folder, cfg), own_folder=folder)
    except StartOver as over:
        return Choice(note=str(over))
    except TrainConfigError as exc:
        return Choice(folder=folder, error=str(exc))


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


def agree(
    world: World, log: RunLog, cfg: TrainConfig, choice: Choice
) -> tuple[ckpt.TrainingState | None, Path | None]:
    """Every rank: rank 0's state and folder (None, None: step 0). Raises TrainConfigError
    on every rank when rank 0 refused its checkpoint, once every rank has heard it."""
    if world.is_main:
        decision = {
            "error": choice.error,
            "folder": os.path.abspath(choice.folder) if choice.folder and choice.state else None,
            "step": choice.state.step if choice.state else 0,
            "run": os.environ.get(RESUMED_RUN_ENV) or "",
            "fingerprint": fingerprint(choice.folder) if choice.state else "",
        }
        world.publish("resume", json.dumps(decision))
        if choice.note:
            log.line(choice.note)
    else:
        decision = json.loads(world.read("resume"))
    if decision["error"] is not None:
        _leave_together(world)
        raise TrainConfigError(
            decision["error"]
            if world.is_main
            else f"rank 0 refused its checkpoint, so no rank resumes: {decision['error']}"
        )
    folder = decision["folder"]
    if not world.is_main and choice.own_folder is not None:
        own = os.path.abspath(choice.own_folder)
        if own != folder:
            follows = f"resumes from {folder}" if folder else "starts at step 0"
            log.line(f"resume: rank 0 {follows}; this rank's own {own} is not used")
    if folder is None:
        return None, None

    readable = world.is_main or _readable(folder, decision["fingerprint"])
    if world.vote("resume-transfer", 0 if readable else 1) == 0:
        state = choice.state if world.is_main else ckpt.load_checkpoint(Path(folder))
        source = "" if world.is_main else " (rank 0's choice, read here)"
    else:  # some rank cannot read it: one broadcast from rank 0, every rank takes it
        state = world.broadcast_state(choice.state, cfg.runtime)
        source = "" if world.is_main else " (from rank 0)"
    # Rank 0 names the folder as it was given; the others by rank 0's absolute path.
    path = choice.folder if world.is_main else Path(folder)
    log.line(resume_line(path, state, run=decision["run"] or "(by hand)") + source)
    return state, path


def _leave_together(world: World) -> None:
    """Rank 0 refused to resume: every rank has read why before rank 0 (the store's host
    without torchrun) leaves; a peer gone meanwhile changes nothing, we exit 2 anyway."""
    try:
        world.finish()
    except PeerFailure:
        world.close()
