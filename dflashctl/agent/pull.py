"""The `pull_plan` verb: which files `dflashctl pull` copies from a run, with their
sizes and modes. Their sha256 is not taken here: the client's reader stream hashes
each file as it reads it (one read of each file, not two) and sends the digest after
its last byte, which the client checks what arrived against.

A run's checkpoints are `runs/<id>/outputs/checkpoints/<step folder>/` (lineage.py);
the serving export is the checkpoint's `drafter/` folder (Hugging Face format); the
metrics are `runs/<id>/metrics.jsonl`, meta.json and every tracker's local files:
TensorBoard's event files, a W&B offline run (`wandb/`, for `wandb sync` later) and an
MLflow file store (`mlruns/`), each at its place in the run folder. A file that grows
while it is pulled (metrics.jsonl of a running run) is pulled up to the size it had
here, which the sha256 is of.

Links are never followed (a link could lead anywhere in the container): they are
named in the answer's `links` and left out. Each file's mode travels with it.

The paths and sizes are also left in a file of this user's alone (`list`), which the
client's one reader stream (dflashctl/ops/pull.py) reads: a command line has no room
for 100,000 paths.
"""

import json
import os
import stat
import tempfile
import time

from .checkpoint_folders import CHECKPOINTS, checkpoint_step, step_folders
from .lineage import latest_checkpoint, own_checkpoint
from .runs import run_ids, runs_dir

METRICS_FILES = ("metrics.jsonl", "meta.json")
TENSORBOARD_MARK = "events.out.tfevents"
TRACKER_FOLDERS = ("wandb", "mlruns")  # W&B offline runs, an MLflow file store


def tree_files(folder, prefix, links=None, skip=()):
    """(local relative path, absolute path) of every plain file under folder; links
    (to files or folders) are not followed but added to `links`; folders whose path
    relative to `folder` is in `skip`, and hidden ones, are not entered. One scandir
    a folder: the kinds come with the names, no stat a file (100,000 files)."""
    found = []

    def walk(path, rel):
        try:
            entries = sorted(os.scandir(path), key=lambda entry: entry.name)
        except OSError:
            return
        for entry in entries:
            name = os.path.join(rel, entry.name) if rel else entry.name
            if entry.is_symlink():
                if links is not None:
                    target = os.readlink(entry.path)
                    links.append({"rel": os.path.join(prefix, name), "target": target})
            elif entry.is_dir(follow_symlinks=False):
                if not entry.name.startswith(".") and name not in skip:
                    walk(entry.path, name)
            elif entry.is_file(follow_symlinks=False):
                found.append((os.path.join(prefix, name), entry.path))

    walk(folder, "")
    return found


def describe(entries):
    described = []
    for rel, path in entries:
        info = os.lstat(path)
        described.append(
            {
                "rel": rel,
                "path": path,
                "size": info.st_size,
                "mode": stat.S_IMODE(info.st_mode) & 0o777,
            }
        )
    return described


LIST_KEPT_S = 24 * 3600


def leave_list(files):
    """[[path, size], ...] of the files in a new file only this user can read (the
    lists of pulls more than a day old are removed)."""
    folder = tempfile.gettempdir()
    for name in os.listdir(folder):
        if name.startswith("dflashctl-pull-") and name.endswith(".json"):
            try:
                info = os.lstat(os.path.join(folder, name))
                if info.st_uid == os.getuid() and time.time() - info.st_mtime > LIST_KEPT_S:
                    os.unlink(os.path.join(folder, name))
            except OSError:
                pass
    fd, path = tempfile.mkstemp(prefix="dflashctl-pull-", suffix=".json")
    with os.fdopen(fd, "w") as out:
        json.dump([[f["path"], f["size"]] for f in files], out)
    return path


def op_pull_plan(p):
    workdir, run_id, step = p["workdir"], p["run_id"], p.get("step")
    run_dir = os.path.join(runs_dir(workdir), run_id)
    if not os.path.isdir(run_dir):
        return {"found": False, "runs": run_ids(workdir)[-10:]}
    steps = step_folders(os.path.join(run_dir, CHECKPOINTS))  # the complete checkpoints
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
    entries, links = [], []
    if checkpoint is not None and p.get("checkpoint", True):
        name = os.path.basename(checkpoint["folder"].rstrip("/"))
        checkpoint["name"] = name
        checkpoint["export"] = os.path.isdir(os.path.join(checkpoint["folder"], "drafter"))
        entries += tree_files(checkpoint["folder"], os.path.join("checkpoints", name), links)
    answer["checkpoint"] = checkpoint
    if p.get("metrics", True):
        for name in METRICS_FILES + TRACKER_FOLDERS:
            path = os.path.join(run_dir, name)
            if os.path.islink(path):
                links.append({"rel": name, "target": os.readlink(path)})
            elif name in METRICS_FILES and os.path.isfile(path):
                entries.append((name, path))
            elif name in TRACKER_FOLDERS and os.path.isdir(path):
                entries += tree_files(path, name, links)
        # TensorBoard's event files where the trainer put them (tensorboard/ in the
        # bundled one), under tensorboard/ when they were elsewhere.
        elsewhere = []
        skip = (CHECKPOINTS,) + TRACKER_FOLDERS  # (pulled above, or not at all)
        for rel, path in tree_files(run_dir, "", elsewhere, skip):
            if TENSORBOARD_MARK in os.path.basename(rel):
                top = rel.split(os.sep, 1)[0] == "tensorboard"
                entries.append((rel if top else os.path.join("tensorboard", rel), path))
        links += [
            link
            for link in elsewhere
            if TENSORBOARD_MARK in link["rel"] or link["rel"].split(os.sep, 1)[0] == "tensorboard"
        ]
    answer["links"] = sorted(links, key=lambda link: link["rel"])
    answer["files"] = describe(entries)
    answer["list"] = leave_list(answer["files"])
    return answer
