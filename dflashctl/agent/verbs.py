"""One function per verb: each takes the call's parameters and returns its answer.

  inspect  the current release and its real manifest, runs to stop; changes nothing
  launch   stop stale runs, swap `current` to the release, start the run detached,
           record it, garbage-collect old releases (a deploy with nothing to send,
           and restart)
  deploy   build the release (unpack an archive of changed files into
           releases/<id>.partial, link the unchanged ones from the base release,
           validate, rename to releases/<id>), then launch, under one lock
  stop     stop the active run and hand-started ones
  runs     runs and their real state (from pid and exit_code files, never from logs)
  prune    remove ended runs' folders beyond the newest N (never the active or a running one)
  hello    nothing: the container keeps the agent (see dflashctl/agent_client.py)
  metrics  runs' metrics.jsonl records, following each run's resumed-from lineage
           (metrics.py)
  log      stream a run's train.log in frames (logreader.py; main.py runs it directly)

Every verb that changes the workdir holds its lock from its first check to its last
change, so what it checked is still true when it acts.
"""

import os
import platform
import shutil
import time

from .errors import AgentError, StaleBase
from .files import lock_workdir, tree_bytes
from .manifest import real_manifest
from .metrics import op_metrics
from .processes import process_table
from .releases import build_release, current_release, gc_releases, releases_dir, swap_current
from .runs import (
    active_run_id,
    run_ids,
    run_record,
    run_state,
    runs_dir,
    start_run,
)
from .stopping import find_targets, stop_targets


def op_inspect(p):
    workdir, entry = p["workdir"], p["entry"]
    release = current_release(workdir)
    manifest = real_manifest(os.path.join(releases_dir(workdir), release)) if release else None
    return {
        "python": platform.python_version(),
        "release": release,
        "manifest": manifest,
        "active_run": active_run_id(workdir),
        "to_stop": find_targets(workdir, entry, p.get("scope", "container")),
    }


def op_stop(p):
    workdir = p["workdir"]
    lock = lock_workdir(workdir)
    try:
        stopped = stop_targets(
            workdir,
            find_targets(workdir, p["entry"], p.get("scope", "container")),
            float(p["grace_s"]),
        )
    finally:
        os.close(lock)
    return {
        "stopped": stopped,
        "all_stopped": all(s["ended"] != "still running after SIGKILL" for s in stopped),
    }


def op_launch(p):
    """Stop what runs, point `current` at the release, start the run, record it, clean up."""
    lock = lock_workdir(p["workdir"])
    try:
        return launch(p)
    finally:
        os.close(lock)


def op_deploy(p):
    """build, then launch, under one lock: the new release is complete and validated
    before anything is stopped; a failed build stops nothing, and no other deploy,
    restart or stop can come between the two."""
    lock = lock_workdir(p["workdir"])
    try:
        started = time.monotonic()
        built = build_release(p)
        built["seconds"] = round(time.monotonic() - started, 3)
        launch_params = {k: v for k, v in p.items() if k != "expect"}
        launched = launch(dict(launch_params, release=built["release"]))
    finally:
        os.close(lock)
    launched["build"] = built
    return launched


def launch(p):
    """The launch itself; the caller holds the workdir lock.

    The release is checked before anything is stopped; `current` is swapped only
    after the old run is gone, so an interruption before that leaves both as they were.
    """
    workdir, run_id = p["workdir"], p["run_id"]
    release = p.get("release") or current_release(workdir)
    expect = p.get("expect")
    if expect is not None and current_release(workdir) != expect["release"]:
        # The caller's plan (from its last deploy) is out of date; nothing was changed.
        raise StaleBase(
            f"the current release is {current_release(workdir)}, not {expect['release']}"
        )
    if not release:
        raise AgentError(f"nothing is deployed in {workdir} yet", "run `dflashctl deploy` first")
    release_dir = os.path.join(releases_dir(workdir), release)
    if not os.path.isdir(release_dir):
        raise AgentError(
            f"release {release} is not in {releases_dir(workdir)}", "run `dflashctl deploy`"
        )
    if not os.path.isfile(os.path.join(release_dir, p["entry"])):
        raise AgentError(
            f"{p['entry']} is not in release {release}",
            "check trainer.entry and trainer.source, then deploy again",
        )
    if expect is not None and real_manifest(release_dir) != expect["manifest"]:
        raise StaleBase(f"release {release} was changed in place")
    t0 = time.monotonic()
    stopped = stop_targets(
        workdir,
        find_targets(workdir, p["entry"], p.get("scope", "container")),
        float(p["grace_s"]),
    )
    stop_s = time.monotonic() - t0
    if any(s["ended"] == "still running after SIGKILL" for s in stopped):
        raise AgentError(
            "a previous run did not exit after SIGKILL; not launching another",
            "check the container with `ps -ef`; the process may be stuck in I/O",
        )
    launch_started = time.monotonic()
    if current_release(workdir) != release:
        swap_current(workdir, release)
    run = start_run(workdir, run_id, release, p)
    protect = [release] + [
        (r.get("meta") or {}).get("release")
        for r in (run_record(workdir, rid) for rid in run_ids(workdir) if rid != run_id)
        if r["status"] == "running"
    ]
    removed = gc_releases(workdir, int(p.get("keep_releases", 5)), protect)
    launch_s = time.monotonic() - launch_started
    return {
        "stopped": stopped,
        "stop_seconds": round(stop_s, 3),
        "launch_seconds": round(launch_s, 3),
        "release": release,
        "run": run,
        "releases_removed": removed,
    }


def op_runs(p):
    workdir = p["workdir"]
    table = process_table()
    wanted = p.get("run_id")
    if wanted == "@active":
        wanted = active_run_id(workdir)
        wanted = [wanted] if wanted else []
    else:
        wanted = [wanted] if wanted else run_ids(workdir)
    runs = [
        run_record(workdir, rid, table)
        for rid in wanted
        if os.path.isdir(os.path.join(runs_dir(workdir), rid))
    ]
    return {"active_run": active_run_id(workdir), "release": current_release(workdir), "runs": runs}


def op_prune(p):
    """Remove the folders of ended runs beyond the newest `keep`. Never the active run
    (launched last) nor one still running, whatever its age. `only` limits it to the
    ids a user confirmed (a run launched meanwhile shifts the oldest ones); `dry` only
    says what would go."""
    workdir = p["workdir"]
    keep = int(p["keep"])
    only = set(p["only"]) if p.get("only") is not None else None
    table = process_table()
    active = active_run_id(workdir)
    ids = run_ids(workdir)
    older = ids[: max(0, len(ids) - keep)]
    removed, spared = [], []
    for rid in older:
        if only is not None and rid not in only:
            continue
        state = run_state(workdir, rid, table)
        if rid == active or state["status"] == "running":
            spared.append(rid)
            continue
        path = os.path.join(runs_dir(workdir), rid)
        size = tree_bytes(path)
        if not p.get("dry"):
            shutil.rmtree(path)
        removed.append(dict(state, id=rid, bytes=size))
    return {"removed": removed, "spared": spared, "runs": len(ids), "dry": bool(p.get("dry"))}


def op_hello(p):
    """Nothing but the answer: a call that makes the container keep the agent."""
    return {"python": platform.python_version()}


# Verbs that answer with one JSON object; `log` (main.py) writes its own frames instead.
OPERATIONS = {
    "inspect": op_inspect,
    "deploy": op_deploy,
    "launch": op_launch,
    "stop": op_stop,
    "runs": op_runs,
    "prune": op_prune,
    "hello": op_hello,
    "metrics": op_metrics,
}
