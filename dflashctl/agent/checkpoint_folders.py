"""A run's checkpoint folders, read from its folder alone.

`runs/<id>/outputs/checkpoints/` holds one folder per checkpoint (`step-000120`) and a
file `latest` naming the newest complete one. Standard library only, Python 3.6: the
agent (lineage) and the run's supervisor program (which carries this file) both read
checkpoints by these rules, so a restart after a crash and a redeploy agree on where
a run stands.
"""

import os
import re

CHECKPOINTS = os.path.join("outputs", "checkpoints")
LATEST = "latest"
STEP_NAME = re.compile(r"(?:^|[^0-9])0*([0-9]+)$")


def checkpoint_step(folder):
    """The step a checkpoint folder holds, from its name (`step-000120`), else None."""
    match = STEP_NAME.search(os.path.basename((folder or "").rstrip("/")))
    return int(match.group(1)) if match else None


def newest_complete(run_dir):
    """The newest complete checkpoint run `run_dir` wrote itself, or None: the one
    `latest` names, else (a pointer naming a missing folder, or none) the newest on
    disk."""
    base = os.path.join(run_dir, CHECKPOINTS)
    try:
        with open(os.path.join(base, LATEST), encoding="utf-8") as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if name and not name.startswith(".") and "/" not in name:
        folder = os.path.join(base, name)
        if os.path.isdir(folder):
            return folder
    return newest_on_disk(base)


def step_folders(base):
    """[(step, name)] of the step folders under `base`, oldest first (hidden ones are
    half-written)."""
    try:
        names = os.listdir(base)
    except OSError:
        return []
    found = []
    for name in names:
        step = checkpoint_step(name)
        if (
            not name.startswith(".")
            and step is not None
            and os.path.isdir(os.path.join(base, name))
        ):
            found.append((step, name))
    return sorted(found)


def newest_on_disk(base):
    """The step folder with the highest step under `base` (empty ones hold nothing), or
    None."""
    for _, name in reversed(step_folders(base)):
        try:
            if os.listdir(os.path.join(base, name)):
                return os.path.join(base, name)
        except OSError:
            continue
    return None
