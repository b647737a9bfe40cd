"""The trainer's metrics.jsonl of runs, for `dflashctl runs show`: each run's records
with those of the runs it resumed from, in one call."""

import json
import os

from .processes import process_table
from .runs import active_run_id, run_record, runs_dir

METRICS_FILE = "metrics.jsonl"  # written by the trainer in its run folder
LINEAGE_MAX = 100  # resumed-from hops followed at most (a loop in meta.json ends too)


def read_metrics(run_dir, max_points):
    """The records of run_dir/metrics.jsonl: every record that is not a step, and at
    most `max_points` step records, evenly spread, the last always kept; (None, 0)
    without the file. A line still being written (or any line that is not a JSON
    object) is skipped."""
    steps, others = [], []
    try:
        f = open(os.path.join(run_dir, METRICS_FILE), "rb")
    except OSError:
        return None, 0
    with f:
        for raw in f:
            try:
                record = json.loads(raw.decode("utf-8"))
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            (steps if record.get("kind") == "step" else others).append(record)
    total = len(steps)
    if max_points and total > max_points:
        stride = total / float(max_points)
        steps = [steps[int(i * stride)] for i in range(max_points - 1)] + [steps[-1]]
    return others + steps, total


def is_run_folder(workdir, run_id):
    """A run id names a folder right under runs/ (never a path elsewhere)."""
    if not run_id or "/" in run_id or run_id.startswith("."):
        return False
    return os.path.isdir(os.path.join(runs_dir(workdir), run_id))


def op_metrics(p):
    """Each run's metrics.jsonl, with those of the runs it resumed from (meta.json's
    `resumed_from`, a run id), oldest first, so a curve can continue across redeploys."""
    workdir = p["workdir"]
    table = process_table()
    answers, missing = [], []
    for wanted in p["run_ids"]:
        run_id = active_run_id(workdir) if wanted == "@active" else wanted
        if not is_run_folder(workdir, run_id):
            missing.append(wanted)
            continue
        lineage, seen = [], set()
        while run_id and run_id not in seen and len(lineage) < LINEAGE_MAX:
            seen.add(run_id)
            if not is_run_folder(workdir, run_id):
                lineage.append({"id": run_id, "missing": True})  # pruned since
                break
            record = run_record(workdir, run_id, table)
            rows, total = read_metrics(os.path.join(runs_dir(workdir), run_id), p.get("max_points"))
            lineage.append({"id": run_id, "record": record, "metrics": rows, "step_records": total})
            meta = record["meta"] if isinstance(record["meta"], dict) else {}
            parent = meta.get("resumed_from")
            run_id = parent if isinstance(parent, str) else None
        lineage.reverse()
        answers.append({"id": lineage[-1]["id"], "lineage": lineage})
    return {"runs": answers, "missing": missing, "active_run": active_run_id(workdir)}
