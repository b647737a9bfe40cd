"""The `stacks` verb: ask a live run's ranks for every thread's stack, and collect what
the run left on its own (its watchdog's dumps, the NCCL flight recorder's).

The trainer (trainer/dflash/pipeline/stacks.py) polls `<run>/stacks/request`; each of
its processes says who it is in `stacks/rank<R>.pid` and answers a new request id with
`stacks/rank<R>.<id>.json`. The flight recorder dumps `nccl_trace/rank_<R>` (pickles:
sent as they are, in base64; the client reads them, never this agent).
"""

import base64
import os
import re
import time

from .errors import AgentError
from .files import read_json, remove_file, write_atomic
from .processes import read_proc
from .runs import FLIGHT_RECORDER_DIR, active_run_id, run_pid_alive, run_state, runs_dir

STACKS_DIR = "stacks"
POLL_S = 0.05
# A dump bigger than this is not sent whole (a ring of 2000 entries is ~1 MiB).
MAX_DUMP_BYTES = 16 << 20
_RANK_PID = re.compile(r"^rank(\d+)\.pid$")
_RANK_WATCHDOG = re.compile(r"^rank(\d+)\.watchdog\.json$")
_RANK_FILE = re.compile(r"^[A-Za-z_]*?(\d+)$")


def rank_files(folder, pattern):
    """{rank: JSON} of the files in `folder` whose names `pattern` matches (the rank
    its group), left out when unreadable."""
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    found = {}
    for name in names:
        m = pattern.match(name)
        record = read_json(os.path.join(folder, name)) if m else None
        if record is not None:
            found[int(m.group(1))] = record
    return found


def live_ranks(folder, run_id):
    """{rank: pid} of the run's processes that said who they are and still live."""
    ranks = {}
    for rank, record in rank_files(folder, _RANK_PID).items():
        pid = record.get("pid") if isinstance(record, dict) else None
        if isinstance(pid, int) and run_pid_alive(pid, run_id):
            ranks[rank] = pid
    return ranks


def watchdog_dumps(folder):
    return [record for _, record in sorted(rank_files(folder, _RANK_WATCHDOG).items())]


def flight_recorder_dumps(run_dir):
    """[{"rank", "file", "bytes", "data" (base64) | "too_big"}] of nccl_trace/."""
    folder = os.path.join(run_dir, FLIGHT_RECORDER_DIR)
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    dumps = []
    for name in names:
        m = _RANK_FILE.match(name)
        path = os.path.join(folder, name)
        if not m or not os.path.isfile(path):
            continue
        size = os.path.getsize(path)
        entry = {"rank": int(m.group(1)), "file": path, "bytes": size}
        if size > MAX_DUMP_BYTES:
            entry["too_big"] = True
        else:
            with open(path, "rb") as f:
                entry["data"] = base64.b64encode(f.read()).decode("ascii")
        dumps.append(entry)
    return dumps


def process_state(pid):
    """The process's state letter from /proc (R, S, D, T: stopped, t: traced, Z); "?"."""
    proc = read_proc(pid)
    return proc.state if proc else "?"


def op_stacks(p):
    """{"run_id", "status", "asked": [ranks], "answers": [dumps], "missing": [ranks],
    "watchdog": [dumps], "flight_recorder": [...]}: waits up to `wait_s` for every live
    rank to answer."""
    workdir = p["workdir"]
    run_id = p.get("run_id") or active_run_id(workdir)
    if not run_id:
        raise AgentError(f"no run launched in {workdir} yet", "start one with `dflashctl deploy`")
    run_dir = os.path.join(runs_dir(workdir), run_id)
    if "/" in run_id or run_id.startswith(".") or not os.path.isdir(run_dir):
        raise AgentError(
            f"no run {run_id} in {runs_dir(workdir)}", "list the runs with `dflashctl runs`"
        )
    folder = os.path.join(run_dir, STACKS_DIR)
    state = run_state(workdir, run_id)
    asked, answers, missing = [], [], []
    stopped = {}  # rank (as text) -> pid of a missing rank whose process is stopped
    if state["status"] == "running":
        ranks = live_ranks(folder, run_id)
        asked = sorted(ranks)
        if asked:
            request = base64.b16encode(os.urandom(6)).decode("ascii").lower()
            write_atomic(os.path.join(folder, "request"), request + "\n")
            deadline = time.monotonic() + float(p.get("wait_s", 10))
            pending = set(asked)
            while pending and time.monotonic() < deadline:
                for rank in sorted(pending):
                    path = os.path.join(folder, f"rank{rank}.{request}.json")
                    record = read_json(path)
                    if record is not None:
                        answers.append(record)
                        pending.discard(rank)
                        remove_file(path)  # asked again, answered anew: no pile of old dumps
                if pending:
                    time.sleep(POLL_S)
            missing = sorted(pending)
            stopped = {
                str(rank): ranks[rank] for rank in missing if process_state(ranks[rank]) in "Tt"
            }
    answers.sort(key=lambda record: record.get("rank", 0))
    return {
        "run_id": run_id,
        "run_dir": run_dir,
        "status": state["status"],
        "asked": asked,
        "answers": answers,
        "missing": missing,
        "stopped": stopped,
        "watchdog": watchdog_dumps(folder),
        "flight_recorder": flight_recorder_dumps(run_dir),
    }
