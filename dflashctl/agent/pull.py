"""The `pull_plan` verb: which files `dflashctl pull` copies from a run, with their
sizes and sha256 (taken here, so the client checks what arrived against the source).

A run's checkpoints are `runs/<id>/outputs/checkpoints/<step folder>/` (lineage.py);
the serving export is the checkpoint's `drafter/` folder (Hugging Face format); the
metrics are `runs/<id>/metrics.jsonl`, its TensorBoard files and meta.json. A file
that grows while it is pulled (metrics.jsonl of a running run) is pulled up to the
size it had here, which the sha256 is of.
"""

import os

from .checkpoint_folders import CHECKPOINTS, checkpoint_step
from .files import sha256_file
from .lineage import latest_checkpoint, own_checkpoint
from .runs import run_ids, runs_dir

METRICS_FILES = ("metrics.jsonl", "meta.json")
TENSORBOARD_MARK = "events.out.tfevents"


def run_steps(run_dir):
    """[(step, folder name)] of the run's complete checkpoints, oldest first."""
    base = os.path.join(run_dir, CHECKPOINTS)
    try:
        names = os.listdir(base)
    except OSError:
        return []
    steps = []
    for name in names:
        step = checkpoint_step(name)
        if (
            not name.startswith(".")
            and step is not None
            and os.path.isdir(os.path.join(base, name))
        ):
            steps.append((step, name))
    return sorted(steps)


def tree_files(folder, prefix):
    """(local relative path, absolute path) of every file under folder, sorted."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = os.path.join(root, name)
            found.append((os.path.join(prefix, os.path.relpath(path, folder)), path))
    return found


def describe(entries):
    return [
        {"rel": rel, "path": path, "size": os.path.getsize(path), "sha256": sha256_file(path)}
        for rel, path in entries
    ]


def op_pull_plan(p):
    workdir, run_id, step = p["workdir"], p["run_id"], p.get("step")
    run_dir = os.path.join(runs_dir(workdir), run_id)
    if not os.path.isdir(run_dir):
        return {"found": False, "runs": run_ids(workdir)[-10:]}
    steps = run_steps(run_dir)
    answer = {"found": True, "run_dir": run_dir, "steps": [s for s, _ in steps]}
    checkpoint = None
    if step is not None:
        names = [name for s, name in steps if s == int(step)]
        if not names:
            answer["missing_step"] = True
        else:
            checkpoint = {
                "run_id": run_id,
                "step": int(step),
                "folder": os.path.join(run_dir, CHECKPOINTS, names[0]),
            }
    else:
        own = own_checkpoint(workdir, run_id)
        if own is not None:
            checkpoint = {"run_id": run_id, "step": checkpoint_step(own), "folder": own}
        else:  # none of its own: the one its training stands on (it resumed from it)
            head = latest_checkpoint(workdir, run_id)
            if head is not None:
                checkpoint = {
                    "run_id": head["run_id"],
                    "step": head["step"],
                    "folder": head["checkpoint"],
                }
    entries = []
    if checkpoint is not None and p.get("checkpoint", True):
        name = os.path.basename(checkpoint["folder"].rstrip("/"))
        checkpoint["name"] = name
        checkpoint["export"] = os.path.isdir(os.path.join(checkpoint["folder"], "drafter"))
        entries += tree_files(checkpoint["folder"], os.path.join("checkpoints", name))
    answer["checkpoint"] = checkpoint
    if p.get("metrics", True):
        for name in METRICS_FILES:
            if os.path.isfile(os.path.join(run_dir, name)):
                entries.append((name, os.path.join(run_dir, name)))
        for rel, path in tree_files(run_dir, ""):
            if TENSORBOARD_MARK in os.path.basename(rel) and not rel.startswith(
                "outputs/checkpoints"
            ):
                entries.append((os.path.join("tensorboard", rel), path))
    answer["files"] = describe(entries)
    return answer
