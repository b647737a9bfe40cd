"""The part of a deploy or restart that must finish once it has begun: stop the old
run, swap `current`, launch, record.

It runs in a child of its own session (`detached`), so neither a dropped SSH session
nor Ctrl-C on the client (which reach the agent that forked it) can cut it short
between stopping the old run and launching the new one. The agent waits for the
child and relays its answer; when the agent is gone, the child finishes alone and
`dflashctl` learns the outcome from the workdir (the `settle` verb).

Everything that can fail for want of space is done before the old run is stopped:
the free space is checked and the new run's folder is made with its files. If the
launch still fails after the stop, the previous release is launched again,
continuing from the stopped run's checkpoint, and the error says so. Across several
nodes that happens on every node, not only where the launch failed (`undo_launch`):
a run is on every node or on none.
"""

import json
import os
import shutil
import signal

from . import commit
from .errors import AgentError, CommitAborted, RolledBack, StaleBase, error_answer
from .lineage import fill_placeholders, latest_checkpoint, lineage_meta, resume_env
from .releases import current_release, swap_current
from .runs import WRAPPER, run_meta, runs_dir, start_run
from .stopping import stop_runs

# What launching needs on disk after the stop (pid, meta.json, active_run, the
# `current` link, the first log lines); checked before anything is stopped.
MIN_FREE_BYTES = 1 << 20


def prepare_run(workdir, run_id, p):
    """Make runs/<id>/ with its wrapper before the old run is stopped; a failure
    (no space, say) leaves no half-made folder and stops nothing."""
    need = int(p.get("min_free_bytes", MIN_FREE_BYTES))
    os.makedirs(runs_dir(workdir), exist_ok=True)
    st = os.statvfs(workdir)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise AgentError(
            f"only {free // 1024} KiB free in {workdir} (a launch needs {need // 1024} KiB); "
            "nothing was stopped",
            "free some space (`dflashctl runs --prune 5` removes old runs' folders), "
            "then deploy again",
        )
    run_dir = os.path.join(runs_dir(workdir), run_id)
    try:
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, WRAPPER), "w", encoding="utf-8") as f:
            f.write(p["supervisor"])
        # The log file exists from the start: writing it cannot be what fails later.
        open(os.path.join(run_dir, "train.log"), "ab").close()
    except OSError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise AgentError(
            f"cannot make the run folder {run_dir}: {exc.strerror}; nothing was stopped",
            "free some space (`dflashctl runs --prune 5`), then deploy again",
        ) from None
    return run_dir


def launch_run(workdir, run_id, release, previous, p):
    """Swap `current` and start the run, continuing `previous` unless `fresh`."""
    # Asked after the stop: a stopped run writes its last checkpoint on the way out.
    resume = None if p.get("fresh") or not previous else latest_checkpoint(workdir, previous)
    meta = dict(p.get("meta") or {}, **lineage_meta(resume, previous))
    meta["command_template"] = list(p["command"])
    p = dict(
        p,
        command=fill_placeholders(p["command"], resume),
        env=dict(p.get("env") or {}, **resume_env(resume)),
        meta=meta,
    )
    if current_release(workdir) != release:
        swap_current(workdir, release)
    run = start_run(workdir, run_id, release, p)
    run["resume"] = resume
    run["previous_run"] = previous
    run["fresh"] = bool(p.get("fresh"))
    return run


def restore_current(workdir, previous_release):
    """Point `current` back at the previous release (if there was one)."""
    if previous_release and current_release(workdir) != previous_release:
        try:
            swap_current(workdir, previous_release)
        except OSError:
            pass


def relaunch_previous(workdir, failed_id, previous, previous_release, p, why, keep=False):
    """The new run could not start after the old one was stopped: launch the previous
    release again (its own command), continuing the stopped run. Returns the message
    and whether the previous release runs again. `keep`: the new run had started (and
    was stopped): its folder stays, for `runs` and its log."""
    restore_current(workdir, previous_release)
    if not keep:
        shutil.rmtree(os.path.join(runs_dir(workdir), failed_id), ignore_errors=True)
    if not previous or not previous_release:
        return f"launching run {failed_id} failed ({why}); nothing was running before it", False
    old_meta = run_meta(workdir, previous)
    command = old_meta.get("command_template") or old_meta.get("command") or p["command"]
    retry_id = failed_id + "-r"
    retry = dict(p, command=command, fresh=False, meta=dict(old_meta, relaunched_after=failed_id))
    for key in ("run_id", "pid", "started", "started_unix", "resumed_from", "resumed_step"):
        retry["meta"].pop(key, None)
    retry["meta"].pop("resumed_checkpoint", None)
    try:
        prepare_run(workdir, retry_id, dict(retry, min_free_bytes=0))
        run = launch_run(workdir, retry_id, previous_release, previous, retry)
    except (AgentError, OSError) as exc:
        shutil.rmtree(os.path.join(runs_dir(workdir), retry_id), ignore_errors=True)
        reason = exc.message if isinstance(exc, AgentError) else (exc.strerror or str(exc))
        return (
            f"launching run {failed_id} failed ({why}), and relaunching release "
            f"{previous_release} failed too ({reason}): nothing is running"
        ), False
    resume = run.get("resume")
    where = (
        f", continuing run {resume['run_id']} at step {resume['step']} from {resume['checkpoint']}"
        if resume
        else " at step 0 (no checkpoint to continue from)"
    )
    return (
        f"launching run {failed_id} failed ({why}); relaunched the previous release "
        f"{previous_release} as run {retry_id} (pid {run['pid']}){where}"
    ), True


def undo_launch(workdir, run_id, p, previous, previous_release, barrier, outcome):
    """Another node could not launch the run (the launch round failed): take ours down,
    wait until every node's is down, and launch the previous release again here too.
    Raises RolledBack with what this node left."""
    who = commit.failed_nodes(outcome)
    stop_runs(p, {"by": p.get("by") or "deploy", "replaced_by": None})
    # Back to the previous release before waiting on the others: a node killed while it
    # waits still points at the release that ran before the deploy.
    restore_current(workdir, previous_release)
    commit.pass_rollback(barrier, p["grace_s"])
    message, relaunched = relaunch_previous(
        workdir, run_id, previous, previous_release, p, f"{who} could not launch it", keep=True
    )
    raise RolledBack(
        f"{message}; run {run_id} was stopped here, as on every node",
        "fix what the error names on that node, then deploy again",
        relaunched,
        here=False,
    )


def detached(work):
    """Run `work()` in a child of its own session with no tie to our stdin/stdout, and
    relay its answer (or error). If we are killed meanwhile, the child carries on."""
    read_end, write_end = os.pipe()
    # A Ctrl-C or hangup that lands between the fork and the child's setsid must not end
    # the child before its launch (it would leave a run folder and no run): blocked
    # across the fork, ignored by the child once it has its own session.
    quiet = {signal.SIGINT, signal.SIGHUP, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, quiet)
    pid = os.fork()
    if pid != 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, quiet)
    if pid == 0:  # the child: never returns
        try:
            os.close(read_end)
            os.setsid()  # out of our process group: a Ctrl-C or hangup there misses it
            # One that came meanwhile was meant for the old group: dropped, and the
            # usual handlers back (a run started from here inherits them).
            kept = {number: signal.getsignal(number) for number in quiet}
            for number in quiet:
                signal.signal(number, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, quiet)
            for number, handler in kept.items():
                signal.signal(number, handler if handler is not None else signal.SIG_DFL)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            try:
                answer = {"ok": True, "answer": work()}
            except (AgentError, OSError) as exc:
                answer = error_answer(exc)
            except BaseException as exc:  # noqa: BLE001 - whatever it was, say it
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            try:
                os.write(write_end, json.dumps(answer).encode("utf-8"))
            except OSError:
                pass  # nobody listens any more: the workdir holds the outcome
        finally:
            os._exit(0)
    os.close(write_end)
    chunks = []
    while True:
        chunk = os.read(read_end, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_end)
    os.waitpid(pid, 0)
    if not chunks:
        raise AgentError("the launch ended without an answer", "see `dflashctl runs`")
    answer = json.loads(b"".join(chunks).decode("utf-8"))
    if not answer["ok"]:
        if answer.get("stale"):
            raise StaleBase(answer["error"], answer.get("hint"))
        if answer.get("aborted"):
            raise CommitAborted(answer["error"], answer.get("hint"), bool(answer.get("in_doubt")))
        if answer.get("rolled_back"):
            raise RolledBack(
                answer["error"],
                answer.get("hint"),
                relaunched=bool(answer.get("relaunched")),
                here=answer["rolled_back"] == "here",
            )
        raise AgentError(answer["error"], answer.get("hint"))
    return answer["answer"]
