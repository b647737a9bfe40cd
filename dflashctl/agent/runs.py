"""Runs in the workdir: `runs/<id>/` (train.log, pid, exit_code, meta.json) and
`active_run`; their real state comes from the pid and exit_code files and the process
table, never from the log."""

import json
import os
import signal
import sys
import time

from .errors import AgentError
from .files import (
    BYTECODE_DIR,
    oldest_first,
    read_int,
    read_json,
    read_text,
    utc,
    write_atomic,
    write_best_effort,
)
from .processes import alive, process_env, read_proc
from .progress import first_start_step, hang_at_stop, hang_settings, metrics_progress


def runs_dir(workdir):
    return os.path.join(workdir, "runs")


def run_meta(workdir, run_id):
    """The run's meta.json ({} when missing or damaged)."""
    return read_json(os.path.join(runs_dir(workdir), run_id, "meta.json"), {})


def base_env():
    """The agent's environment without what names a run: what a run's starts from."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}


def run_env(p):
    """The run's environment before what names it: trainer.env, then its venv (its
    bin/ first, as `activate` does)."""
    env = dict(base_env(), **(p.get("env") or {}))
    if p.get("venv"):  # the run's venv (venvs.py)
        env["VIRTUAL_ENV"] = p["venv"]
        env["PATH"] = os.path.join(p["venv"], "bin") + ":" + env.get("PATH", "/usr/bin:/bin")
    return env


def run_pid_alive(pid, run_id, table=None):
    """Is `pid` still this run's wrapper? A recycled pid belongs to someone else."""
    if pid is None:
        return False
    proc = table.get(pid) if table is not None else read_proc(pid)
    if not alive(proc):
        return False
    owner = process_env(pid, "DFLASH_RUN_ID")
    if owner is not None:
        return owner == run_id
    return any(run_id in arg for arg in proc.argv)


STOPPED_FILE = "stopped.json"


def record_stop(workdir, run_id, how):
    """Say in the run's folder who stops it, before the signal goes: the run then reads
    as `stopped` (never finished or crashed), whatever exit status the stop leaves."""
    run_dir = os.path.join(runs_dir(workdir), run_id)
    if not os.path.isdir(run_dir):
        return
    record = dict(how, at=utc())
    factor, min_s = hang_settings(run_meta(workdir, run_id))
    hung = hang_at_stop(run_dir, factor, min_s, time.time())
    if hung:
        record["hung"] = hung  # a stop after a hang: the run hung, then was stopped
    # Best effort: on a full disk the run is stopped all the same (it then reads as
    # killed or exited, not `stopped`); stopping must never need free space.
    return write_best_effort(
        os.path.join(run_dir, STOPPED_FILE), json.dumps(record, sort_keys=True)
    )


def run_state(workdir, run_id, table=None):
    """{"status": running|exited|killed|stopped|lost, "exit_code", "signal"} from the
    real state; a stopped run also has "stopped": {"by", "at", "replaced_by"}."""
    run_dir = os.path.join(runs_dir(workdir), run_id)
    code = read_int(os.path.join(run_dir, "exit_code"))
    if code is None:
        if run_pid_alive(read_int(os.path.join(run_dir, "pid")), run_id, table):
            return {"status": "running", "exit_code": None, "signal": None}
        # The wrapper may have written its exit code between the two reads.
        code = read_int(os.path.join(run_dir, "exit_code"))
    if code is None:
        return {"status": "lost", "exit_code": None, "signal": None}
    sig = code - 128 if 128 < code < 128 + 65 else None
    stopped = read_json(os.path.join(run_dir, STOPPED_FILE))
    if stopped is not None:
        return {"status": "stopped", "exit_code": code, "signal": sig, "stopped": stopped}
    if sig is not None:
        return {"status": "killed", "exit_code": code, "signal": sig}
    return {"status": "exited", "exit_code": code, "signal": None}


def run_over(workdir, run_id):
    """Has the run ended (the log reader's end check)? A run folder without a pid file
    yet is a run that is starting, not one that is over."""
    run_dir = os.path.join(runs_dir(workdir), run_id)
    if read_int(os.path.join(run_dir, "pid")) is None:
        return read_int(os.path.join(run_dir, "exit_code")) is not None
    return run_state(workdir, run_id)["status"] != "running"


def run_record(workdir, run_id, table=None):
    run_dir = os.path.join(runs_dir(workdir), run_id)
    meta = run_meta(workdir, run_id)
    record = {"id": run_id, "meta": meta, "pid": read_int(os.path.join(run_dir, "pid"))}
    record.update(run_state(workdir, run_id, table))
    # The supervisor's record of the run's attempts (supervisor.py), or None for a run
    # that has not ended an attempt yet (or was launched before there was one).
    attempts = read_json(os.path.join(run_dir, "attempts.json"))
    record["attempts"] = attempts if isinstance(attempts, dict) else None
    if meta.get("resumed_from"):
        # Whether it continued that run: only the trainer knows (a finished run's
        # checkpoint may start a new training), and says it in its start record.
        record["started_at_step"] = first_start_step(run_dir)
    if record["status"] == "running":
        # Alive is not the same as making progress: a deadlocked trainer stays running.
        factor, min_s = hang_settings(meta)
        ended = [
            a.get("ended_unix")
            for a in (record["attempts"] or {}).get("attempts") or []
            if isinstance(a, dict) and isinstance(a.get("ended_unix"), (int, float))
        ]
        record["progress"] = metrics_progress(
            run_dir, factor, min_s, time.time(), max(ended) if ended else None
        )
    return record


# The run's wrapper, written once when the run is made (its age orders runs of one second).
WRAPPER = "supervise.py"


def never_launched(workdir, run_id):
    """A folder a deploy made before stopping anything (supervise.py, an empty
    train.log) whose run it never launched (interrupted, or it failed before): no pid
    and no meta.json. Not a run: `runs` leaves it out, the next launch removes it."""
    run_dir = os.path.join(runs_dir(workdir), run_id)
    return not any(
        os.path.exists(os.path.join(run_dir, name)) for name in ("pid", "meta.json", "exit_code")
    )


def run_ids(workdir):
    try:
        names = os.listdir(runs_dir(workdir))
    except OSError:
        return []
    base = runs_dir(workdir)
    return oldest_first(
        base,
        [n for n in names if os.path.isdir(os.path.join(base, n))],
        lambda run_dir: os.path.join(run_dir, WRAPPER),
    )


def active_run_id(workdir):
    text = read_text(os.path.join(workdir, "active_run"))
    return text.strip() if text and text.strip() else None


def settle_exit_code(workdir, run_id, was_killed):
    """The exit code the wrapper wrote; if SIGKILL took the wrapper too, write 137 for it."""
    run_dir = os.path.join(runs_dir(workdir), run_id)
    path = os.path.join(run_dir, "exit_code")
    code = read_int(path)
    if code is None and os.path.isdir(run_dir):
        code = 128 + (signal.SIGKILL if was_killed else signal.SIGTERM)
        write_best_effort(path, f"{code}\n")  # the run is gone either way
    return code


# <workdir>/pycache: the one bytecode cache of every run in a workdir. Python writes
# each module's bytecode under the prefix at the module's own real path, so torch's and
# transformers' (84 MB for the bundled trainer) are written once, not once per run, and
# a release's own lie under pycache/<real path of the release>, removed with the
# release (releases.remove_release): keep_releases bounds them.


def bytecode_env(env, workdir):
    """Keep the run's bytecode out of its release: the release stays exactly what was
    deployed (and may be shared with other runs through hard links). Python 3.8+
    caches it in the workdir's shared cache instead; older ones do not write it. A
    trainer.env (or an environment) that says otherwise wins."""
    if "PYTHONPYCACHEPREFIX" in env or "PYTHONDONTWRITEBYTECODE" in env:
        return {}
    if sys.version_info < (3, 8):  # noqa: UP036 (the agent runs on 3.6+; so may the trainer)
        return {"PYTHONDONTWRITEBYTECODE": "1"}
    return {"PYTHONPYCACHEPREFIX": os.path.join(workdir, BYTECODE_DIR)}


ERROR_FILE = "error.json"  # torchelastic's error file of the process the run starts
ELASTIC_LOG_DIR = "torchelastic"  # torchrun's --log-dir: each rank's error.json under it


def error_file_env(env, run_dir):
    """torchelastic's error files in the run's folder, where dflashctl reads them: the
    trainer records the exception that ended it in TORCHELASTIC_ERROR_FILE; torchrun
    gives each rank a file of its own under its log dir (PET_LOG_DIR is --log-dir) and
    copies the first failed rank's to its own TORCHELASTIC_ERROR_FILE. A trainer.env
    (or an environment) that says otherwise wins."""
    out = {}
    if not env.get("TORCHELASTIC_ERROR_FILE"):
        out["TORCHELASTIC_ERROR_FILE"] = os.path.join(run_dir, ERROR_FILE)
    if not env.get("PET_LOG_DIR"):
        out["PET_LOG_DIR"] = os.path.join(run_dir, ELASTIC_LOG_DIR)
    return out


# Where the NCCL flight recorder's dumps go: one file per rank, the rank appended.
FLIGHT_RECORDER_DIR = "nccl_trace"
FLIGHT_RECORDER_PREFIX = "rank_"


def flight_recorder_env(env, run_dir):
    """PyTorch's NCCL flight recorder on, dumping into the run's folder on a collective
    timeout: it names the collective each rank reached (`dflashctl stacks` summarises
    the dumps). Only NCCL process groups read these; gloo and CPU runs ignore them. A
    trainer.env (or an environment) that sets any of them wins."""
    folder = os.path.join(run_dir, FLIGHT_RECORDER_DIR)
    prefix = os.path.join(folder, FLIGHT_RECORDER_PREFIX)
    settings = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        # The names newer PyTorch reads first.
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
    }
    if any(name in env for name in settings):
        return {}
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return {}
    return settings


def start_run(workdir, run_id, release, p):
    # Imported here: the log reader, which starts often and must answer fast, never
    # needs it.
    import subprocess

    run_dir = os.path.join(runs_dir(workdir), run_id)
    command = list(p["command"])
    # The run's wrapper (supervisor.py with the crash detector, one file) and what it
    # decides with: the run keeps them, whatever is deployed later. The wrapper may
    # have been written before the old run was stopped (transaction.prepare_run).
    wrapper = os.path.join(run_dir, WRAPPER)
    if not os.path.isfile(wrapper):
        os.makedirs(run_dir, exist_ok=True)
        write_atomic(wrapper, p["supervisor"])
    settings = dict(p.get("recovery") or {}, command=command)
    write_atomic(os.path.join(run_dir, "recovery.json"), json.dumps(settings, indent=1))
    env = run_env(p)
    env.update({"DFLASH_RUN_ID": run_id, "DFLASH_RUN_DIR": run_dir, "PYTHONUNBUFFERED": "1"})
    env.update(bytecode_env(env, workdir))
    env.update(error_file_env(env, run_dir))
    env.update(flight_recorder_env(env, run_dir))
    log = open(os.path.join(run_dir, "train.log"), "ab")
    try:
        # New session (pid = pgid = sid), no terminal, stdin from /dev/null and our
        # pipes closed, so the exec session that started us returns at once.
        proc = subprocess.Popen(
            # The trainer's interpreter: -S, the wrapper needs only the standard library.
            [command[0], "-S", wrapper, run_dir],
            cwd=os.path.join(workdir, "current"),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        raise AgentError(f"could not start {command[0]}: {exc.strerror}") from None
    finally:
        log.close()
    proc.returncode = 0  # never waited for here: the run outlives this script
    started = time.time()
    try:
        record_started(workdir, run_id, release, p, command, proc.pid, started)
    except OSError:
        # A run we cannot record is a run nobody could find or stop: end it now.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        raise
    return {
        "id": run_id,
        "pid": proc.pid,
        "run_dir": run_dir,
        "started": utc(started),
        "command": command,  # as it runs: from the setup venv's python, if there is one
    }


def record_started(workdir, run_id, release, p, command, pid, started):
    run_dir = os.path.join(runs_dir(workdir), run_id)
    write_atomic(os.path.join(run_dir, "pid"), f"{pid}\n")
    meta = dict(p.get("meta") or {})
    meta.update(
        {
            "run_id": run_id,
            "release": release,
            "command": command,
            "pid": pid,
            "cwd": os.path.join(workdir, "current"),
            "started": utc(started),
            "started_unix": round(started, 3),
        }
    )
    write_atomic(os.path.join(run_dir, "meta.json"), json.dumps(meta, indent=2, sort_keys=True))
    write_atomic(os.path.join(workdir, "active_run"), run_id + "\n")
