"""Resume lineage: which checkpoint a new run continues from.

A run's checkpoints are where the bundled trainer writes them (any trainer may do the
same): `runs/<id>/outputs/checkpoints/`, with a file `latest` naming the newest
complete checkpoint folder, written only after that folder is complete. A run that
wrote none (stopped or crashed before its first checkpoint) hands on the checkpoint it
had itself resumed from, so a lineage never falls back to step 0 by accident.

A run that finished (exited 0 by itself) is not one to continue: its checkpoint is
handed on marked `finished`, and the trainer starts a new training at step 0 unless
it has steps left to train from it (train.steps raised). Only the trainer knows how
many steps it is asked for, so the choice is its own (DFLASH_RESUMED_FINISHED=1).

If `latest` names a folder that is not there (a run killed while it moved the
pointer, or a folder removed by hand), the newest complete step folder on disk is
used: a trainer renames a checkpoint into place only once it is complete, so any
folder with a step name that does not start with "." is one.

`latest_checkpoint` is the one place that answers "where does this run's training
stand"; deploy, restart (and later automatic retries) all ask it.
"""

import os

from .checkpoint_folders import checkpoint_step, newest_complete
from .runs import run_meta, run_state, runs_dir


def own_checkpoint(workdir, run_id):
    """The newest complete checkpoint this run wrote itself, or None."""
    return newest_complete(os.path.join(runs_dir(workdir), run_id))


def run_finished(workdir, run_id):
    """Did the run end by itself with exit status 0 (its training done)?"""
    state = run_state(workdir, run_id)
    return state["status"] == "exited" and state["exit_code"] == 0


def latest_checkpoint(workdir, run_id):
    """Where run `run_id`'s training stands: {"run_id", "checkpoint", "step",
    "finished"} for the newest complete checkpoint of its lineage (its own, else the
    one it resumed from, if that still exists), or None (nothing to continue: start at
    step 0). `finished`: the checkpoint is the end of a run that finished."""
    seen = set()
    while run_id and run_id not in seen:
        seen.add(run_id)
        folder = own_checkpoint(workdir, run_id)
        meta = run_meta(workdir, run_id)
        if folder is not None and not _behind_its_start(folder, meta):
            return {
                "run_id": run_id,
                "checkpoint": folder,
                "step": checkpoint_step(folder),
                "finished": run_finished(workdir, run_id),
            }
        inherited = meta.get("resumed_checkpoint")
        if inherited and os.path.isdir(inherited):
            return {
                "run_id": meta.get("resumed_from") or run_id,
                "checkpoint": inherited,
                "step": meta.get("resumed_step"),
                "finished": bool(meta.get("resumed_finished")),
            }
        run_id = meta.get("resumed_from")
    return None


def _behind_its_start(folder, meta):
    """A checkpoint below the step the run resumed at (an older trainer stopped during
    warm-up wrote "step 0" holding the resumed weights): not where its training stands."""
    step, started = checkpoint_step(folder), meta.get("resumed_step")
    resumed = meta.get("resumed_checkpoint")
    if step is None or not isinstance(started, int) or meta.get("resumed_finished"):
        return False
    return step < started and bool(resumed) and os.path.isdir(resumed)


def fill_placeholders(command, resume):
    """`{resume_from}` in the command becomes the checkpoint folder (empty with none)."""
    value = resume["checkpoint"] if resume else ""
    return [arg.replace("{resume_from}", value) for arg in command]


def resume_env(resume):
    """What a trainer that is not ours reads: the folder (empty: start fresh) and the run."""
    if not resume:
        return {"DFLASH_RESUME_FROM": ""}
    return {
        "DFLASH_RESUME_FROM": resume["checkpoint"],
        "DFLASH_RESUMED_RUN": resume["run_id"],
        "DFLASH_RESUMED_STEP": "" if resume["step"] is None else str(resume["step"]),
        # The run it comes from finished: a trainer starts over unless it has steps left.
        "DFLASH_RESUMED_FINISHED": "1" if resume.get("finished") else "",
    }


def lineage_meta(resume, previous_run):
    """meta.json's record of where the run started (`runs show` joins curves by it)."""
    if not resume:
        return {"resumed_from": None, "replaced_run": previous_run}
    return {
        "resumed_from": resume["run_id"],
        "resumed_step": resume["step"],
        "resumed_checkpoint": resume["checkpoint"],
        "resumed_finished": bool(resume.get("finished")),
        "replaced_run": previous_run,
    }
