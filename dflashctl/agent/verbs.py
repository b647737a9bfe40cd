"""One function per verb: each takes the call's parameters and returns its answer.

  inspect  the current release and its real manifest, runs to stop; changes nothing
  launch   stop stale runs, swap `current` to the release, start the run detached,
           record it, garbage-collect old releases (a deploy with nothing to send,
           and restart)
  deploy   build the release (unpack an archive of changed files into
           releases/<id>.partial, link the unchanged ones from the base release,
           validate, rename to releases/<id>), then launch, under one lock
  build    build the release only (the setup streams before the launch);
           `discard` removes one that will not be launched
  abort    mark a run across several nodes aborted here: this node's launch, waiting
           at the commit barrier, decides abort for every node (commit.py)
  stop     stop the active run and hand-started ones
  runs     runs and their real state (from pid and exit_code files, never from logs)
  prune    remove ended runs' folders beyond the newest N (never the active or a running one)
  settle   after an interrupted deploy: wait for a launch in flight, then say what runs
  hello    nothing: the container keeps the agent (see dflashctl/remote/agent_client.py)
  metrics  runs' metrics.jsonl records, following each run's resumed-from lineage
           (metrics.py)
  address  the container's own address, for the other nodes of a run (network.py)
  listen / probe   a TCP listener and a connection to it: can the nodes reach the
           rendezvous port (network.py)
  stacks   every thread's stack of a live run's ranks, its watchdog's and the NCCL
           flight recorder's dumps (stacks.py)
  log      stream a run's train.log in frames (logreader.py; main.py runs it directly)

Every verb that changes the workdir holds its lock from its first check to its last
change, so what it checked is still true when it acts.
"""

import fcntl
import os
import platform
import resource
import shutil
import time
from contextlib import contextmanager

from . import commit
from .errors import AgentError, RolledBack, StaleBase
from .exec_env import op_exec_ticket
from .files import locked, tree_bytes
from .lineage import latest_checkpoint
from .manifest import real_manifest
from .metrics import op_metrics
from .network import check_job_port, op_address, op_listen, op_probe
from .processes import process_table
from .pull import op_pull_plan
from .releases import (
    build_release,
    current_release,
    gc_releases,
    releases_dir,
    remove_release,
)
from .runs import (
    active_run_id,
    never_launched,
    run_ids,
    run_record,
    run_state,
    runs_dir,
)
from .stacks import op_stacks
from .stopping import find_targets, stop_runs, stuck
from .trainer_check import check_trainer_config, op_trainer_check
from .transaction import detached, launch_run, prepare_run, relaunch_previous, undo_launch
from .venvs import ensure_venv, gc_venvs, op_setup_check


def op_inspect(p):
    workdir, active = p["workdir"], active_run_id(p["workdir"])
    release = current_release(workdir)
    manifest = real_manifest(os.path.join(releases_dir(workdir), release)) if release else None
    return {
        "python": platform.python_version(),
        "release": release,
        "manifest": manifest,
        "active_run": active,
        "to_stop": find_targets(workdir, p["entry"]),
        # What a launch now would continue (a running run's checkpoint may still move).
        "continues": latest_checkpoint(workdir, active) if active else None,
    }


def op_stop(p):
    with locked(p):
        stopped = stop_runs(p, {"by": "stop", "replaced_by": None})
    return {"stopped": stopped, "all_stopped": not any(stuck(s) for s in stopped)}


def op_launch(p):
    """Stop what runs, point `current` at the release, start the run, record it, clean up."""
    with telling_barrier(p), locked(p):
        return launch(p)


@contextmanager
def telling_barrier(p):
    """A launch across nodes that fails here before it arrived at the commit barrier
    tells the barrier: the other nodes need not wait for their deadline to abort."""
    try:
        yield
    except (AgentError, OSError) as exc:
        if not isinstance(exc, commit.CommitAborted):
            commit.signal_abort(p, exc.message if isinstance(exc, AgentError) else str(exc))
        raise


def op_deploy(p):
    """build, then launch, under one lock: the new release is complete and validated
    before anything is stopped; a failed build stops nothing, and no other deploy,
    restart or stop can come between the two."""
    with telling_barrier(p), locked(p):
        # Across nodes: the barrier's interpreter imports torch while the release is built.
        warm = commit.prestart(p)
        try:
            built = timed_build(p)
            launch_params = {k: v for k, v in p.items() if k != "expect"}
            try:
                launched = launch(dict(launch_params, release=built["release"]), warm)
            except AgentError:
                # Refused (or undone) before it became current: no orphan release left.
                if current_release(p["workdir"]) != built["release"]:
                    remove_release(p["workdir"], built["release"])
                raise
        finally:
            commit.cancel(warm)
    launched["build"] = built
    return launched


def op_build(p):
    """build only: a run across several nodes launches nowhere before the release is
    built and verified on every node (the client then calls `launch` on each)."""
    with locked(p):
        built = timed_build(p)
    return {"build": built, "release": built["release"]}


def timed_build(p):
    """build_release, with its wall time and the agent's CPU time so far (user +
    system, its start-up included)."""
    started = time.monotonic()
    built = build_release(p)
    built["seconds"] = round(time.monotonic() - started, 3)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    built["cpu_seconds"] = round(usage.ru_utime + usage.ru_stime, 3)
    return built


def op_discard(p):
    """A built release that will not be launched (another node failed): removed unless
    it became current or a run uses it."""
    with locked(p, wait=True):
        return {"removed": discard_unused(p["workdir"], p["release"])}


def discard_unused(workdir, release):
    """Remove `release` unless it is current or a run uses it; the caller holds the lock."""
    used = {(run_record(workdir, rid).get("meta") or {}).get("release") for rid in run_ids(workdir)}
    path = os.path.join(releases_dir(workdir), release)
    removed = os.path.isdir(path) and current_release(workdir) != release and release not in used
    if removed:
        remove_release(workdir, release)
    return bool(removed)


def launch(p, warm=None):
    """The launch itself; the caller holds the workdir lock. `warm`: the commit
    barrier started ahead (commit.prestart), if any.

    The release is checked before anything is stopped; `current` is swapped only
    after the old run is gone, so an interruption before that leaves both as they were.
    """
    workdir, run_id = p["workdir"], p["run_id"]
    if p.get("commit"):
        commit.clear_leftovers(workdir, run_id)
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
    commit_params = p.get("commit") or {}
    if commit_params.get("job_port") and int(commit_params["rank"]) == 0:
        check_job_port(workdir, commit_params["job_port"])  # before anything is stopped
    p = with_venv(p, release)  # before anything is stopped: a failed setup stops nothing
    checked_at = time.monotonic()
    check_trainer_config(release_dir, p)  # so is a config the trainer would refuse
    check_s = time.monotonic() - checked_at  # the wait for it (started ahead: its rest)
    # The run this one replaces: its training continues here unless `fresh`.
    previous = active_run_id(workdir)
    previous_release = current_release(workdir)
    # Under the workdir lock no other launch is in flight: a folder without a run is
    # what an interrupted deploy left.
    for other in run_ids(workdir):
        if other != run_id and never_launched(workdir, other):
            shutil.rmtree(os.path.join(runs_dir(workdir), other), ignore_errors=True)
    run_dir = prepare_run(workdir, run_id, p)  # before anything is stopped
    try:
        launched = detached(lambda: transaction(p, release, previous, previous_release, warm))
        launched["check_seconds"] = round(check_s, 3)
        return launched
    except AgentError:
        if os.path.isdir(run_dir) and not os.path.exists(os.path.join(run_dir, "pid")):
            shutil.rmtree(run_dir, ignore_errors=True)  # never a half-made run folder
        raise


def with_venv(p, release):
    """The launch from the release's venv (setup.requirements, setup.commands), made
    here if the client's streamed setup did not make it already; p unchanged when the
    setup installs nothing."""
    made = ensure_venv(p["workdir"], release, p.get("setup"), lambda line: None)
    if made is None:
        return p
    command = [made["python"], *p["command"][1:]]
    meta = dict(
        p.get("meta") or {},
        venv=made["venv"],
        venv_key=made["key"],
        venv_made_from=made["made_from"],
    )
    return dict(p, command=command, venv=made["venv"], meta=meta)


def transaction(p, release, previous, previous_release, warm=None):
    """Stop, swap, launch, record: in a child that outlives the caller (detached).
    Across several nodes, every node first agrees at the commit barrier (commit.py):
    on abort nothing is stopped, and the new release and run folder are removed."""
    workdir, run_id = p["workdir"], p["run_id"]
    barrier = None
    if p.get("commit"):
        try:
            barrier = commit.join(p, p["command"][0], release, warm)
        except commit.CommitAborted:
            shutil.rmtree(os.path.join(runs_dir(workdir), run_id), ignore_errors=True)
            if release != previous_release:
                discard_unused(workdir, release)
            raise
    t0 = time.monotonic()
    stopped = stop_runs(p, {"by": p.get("by") or "deploy", "replaced_by": run_id})
    stop_s = time.monotonic() - t0
    left = any(stuck(s) for s in stopped)
    # Across nodes, no node launches before every node stopped its old run (commit.py).
    gate = commit.pass_gate(barrier, not left, p["grace_s"]) if barrier else None
    if left:
        raise AgentError(
            "a previous run did not exit after SIGKILL; not launching another",
            "check the container with `ps -ef`; the process may be stuck in I/O",
        )
    launch_started = time.monotonic()
    try:
        run = launch_run(workdir, run_id, release, previous, p)
    except (AgentError, OSError) as exc:
        why = exc.message if isinstance(exc, AgentError) else (exc.strerror or str(exc))
        if barrier:  # the others learn it at once, and take their new run down
            commit.report_launch(barrier, False, why)
            commit.pass_rollback(barrier, p["grace_s"])
        message, relaunched = relaunch_previous(workdir, run_id, previous, previous_release, p, why)
        raise RolledBack(
            message, "free some space or fix the cause, then deploy again", relaunched
        ) from None
    if barrier:
        launched = commit.report_launch(barrier, True)
        if launched.get("launch") == "failed":
            undo_launch(workdir, run_id, p, previous, previous_release, barrier, launched)
    keep = int(p.get("keep_releases", 5))
    running = [
        r.get("meta") or {}
        for r in (run_record(workdir, rid) for rid in run_ids(workdir))
        if r["status"] == "running"
    ]
    removed = gc_releases(workdir, keep, [release] + [m.get("release") for m in running])
    gc_venvs(workdir, keep, [p.get("venv")] + [m.get("venv") for m in running])
    launch_s = time.monotonic() - launch_started
    answer = {
        "stopped": stopped,
        "stop_seconds": round(stop_s, 3),
        "launch_seconds": round(launch_s, 3),
        "release": release,
        "run": run,
        "releases_removed": removed,
    }
    if gate is not None:
        answer["gate"] = gate
    return answer


def op_runs(p):
    workdir = p["workdir"]
    table = process_table()
    wanted = [p["run_id"]] if p.get("run_id") else run_ids(workdir)
    if wanted == ["@active"]:
        wanted = [rid for rid in [active_run_id(workdir)] if rid]
    runs = [
        run_record(workdir, rid, table)
        for rid in wanted
        if os.path.isdir(os.path.join(runs_dir(workdir), rid)) and not never_launched(workdir, rid)
    ]
    if p.get("sizes"):  # `runs`: what each run's folder takes (checkpoints, logs)
        for record in runs:
            record["bytes"] = tree_bytes(os.path.join(runs_dir(workdir), record["id"]))
    return {"active_run": active_run_id(workdir), "release": current_release(workdir), "runs": runs}


def op_prune(p):
    """Remove the folders of ended runs beyond the newest `keep`. Never the active run
    (launched last), one still running, nor the run holding the checkpoint the next
    deploy would continue from, whatever its age. `only` limits it to the
    ids a user confirmed (a run launched meanwhile shifts the oldest ones); `dry` only
    says what would go."""
    workdir = p["workdir"]
    keep = int(p["keep"])
    only = set(p["only"]) if p.get("only") is not None else None
    table = process_table()
    active = active_run_id(workdir)
    head = latest_checkpoint(workdir, active) if active else None
    ids = run_ids(workdir)
    older = ids[: max(0, len(ids) - keep)]
    removed, spared = [], []
    for rid in older:
        if only is not None and rid not in only:
            continue
        state = run_state(workdir, rid, table)
        if rid == active or state["status"] == "running" or (head and head["run_id"] == rid):
            spared.append(rid)
            continue
        path = os.path.join(runs_dir(workdir), rid)
        size = tree_bytes(path)
        if not p.get("dry"):
            shutil.rmtree(path)
        removed.append(dict(state, id=rid, bytes=size))
    return {"removed": removed, "spared": spared, "runs": len(ids), "dry": bool(p.get("dry"))}


def op_settle(p):
    """After a client was interrupted mid-deploy: wait (up to `wait_s`) for a launch
    in flight to end (it holds the workdir lock), then say what runs: the run that
    deploy was launching (`run_id`), and the active one."""
    workdir = p["workdir"]
    deadline = time.monotonic() + float(p.get("wait_s", 60))
    busy = os.path.isdir(workdir)
    if busy:
        fd = os.open(os.path.join(workdir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while busy:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    busy = False
                except OSError:
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.05)
        finally:
            os.close(fd)
    table = process_table()
    active = active_run_id(workdir)
    launched = p.get("run_id")
    exists = launched and os.path.isfile(os.path.join(runs_dir(workdir), launched, "pid"))
    return {
        "busy": busy,
        "active_run": run_record(workdir, active, table) if active else None,
        "launched": run_record(workdir, launched, table) if exists else None,
        "release": current_release(workdir),
    }


def op_hello(p):
    """Nothing but the answer: a call that makes the container keep the agent."""
    return {"python": platform.python_version()}


# Verbs that answer with one JSON object; `log` (main.py) writes its own frames instead.
OPERATIONS = {
    "inspect": op_inspect,
    "deploy": op_deploy,
    "build": op_build,
    "discard": op_discard,
    "abort": commit.op_abort,
    "launch": op_launch,
    "stop": op_stop,
    "runs": op_runs,
    "prune": op_prune,
    "settle": op_settle,
    "hello": op_hello,
    "exec_ticket": op_exec_ticket,
    "metrics": op_metrics,
    "address": op_address,
    "listen": op_listen,
    "probe": op_probe,
    "setup_check": op_setup_check,
    "trainer_check": op_trainer_check,
    "pull_plan": op_pull_plan,
    "stacks": op_stacks,
}
