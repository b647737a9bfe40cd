"""Continuing another run's training: the checkpoint folder dflashctl hands over.

dflashctl starts a redeployed run with ``DFLASH_RESUME_FROM`` set to the replaced
run's latest complete checkpoint folder (and ``DFLASH_RESUMED_RUN`` to that run's id);
``--resume-from PATH`` does the same by hand. The run then starts from exactly that
checkpoint and writes into its own output_dir, leaving the old one as it was.

Everything that can make the checkpoint unusable is checked here, before the slow
set-up (building the target, making data), so a misfit fails within seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

from dflash.pipeline import checkpointing as ckpt
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
