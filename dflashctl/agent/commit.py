"""The agent's side of the commit barrier of a run across several nodes
(commit_barrier.py has the protocol).

A launch that carries `commit` ({world, rank, names, address, port, run_id,
deadline_s, program}) asks the barrier, once its release is built and checked and
the run's folder made, and before anything is stopped: `join` raises CommitAborted
on abort, having changed nothing, and on commit returns the barrier, which
`pass_gate` then holds until every node has stopped its old run (the stop gate: no
node launches while node 0's old torchrun may still hold the job's store). Then
`report_launch` tells the others whether the new run started here and learns whether
it did everywhere; if not, every node takes its new run down and, past `pass_rollback`,
launches the previous release again (agent/transaction.py's `undo_launch`). The
barrier program runs in the run's interpreter (it needs torch), started ahead by
`prestart` while the release is built; this module stays standard-library only.

  abort   the verb the client calls on the other nodes when one fails: it writes
          the run's abort marker (no lock: the node waiting at the barrier holds it),
          which the barrier there sees within a tenth of a second

A node that fails before it arrives tells the barrier itself (`signal_abort`, in the
background), so the others need not wait for their deadline when nobody is left to
call `abort`. What an attempt leaves (markers, a background abort) is cleared by the
next launch on the workdir (`clear_leftovers`).
"""

import json
import os
import select
import signal
import subprocess
import tempfile
import time

from .errors import AgentError, CommitAborted
from .files import remove_file, write_atomic

# How long past its deadline the barrier may take (importing torch, which takes tens of
# seconds on a loaded machine; node 0 waiting for the others to read the decision)
# before the agent gives up on it.
SLACK_S = 180.0
# How long past the stop's grace the gate waits for the other nodes' stops.
GATE_SLACK_S = 60.0
# How long a node that launched waits to hear whether every other node did (they
# launch within moments of each other, once the gate opened).
LAUNCH_WAIT_S = 120.0


def commit_dir(workdir):
    return os.path.join(workdir, ".commit")


def marker_path(workdir, run_id):
    return os.path.join(commit_dir(workdir), run_id + ".abort")


def holder_path(workdir, run_id):
    return os.path.join(commit_dir(workdir), run_id + ".pid")


def safe_run_id(run_id):
    if not run_id or "/" in run_id or run_id.startswith("."):
        raise AgentError(f"not a run id: {run_id!r}", "this is a bug in dflashctl")
    return run_id


def op_abort(p):
    """Mark run `run_id` aborted on this node: a barrier waiting here (or arriving
    later) decides abort, unless every node had arrived already (then it committed)."""
    workdir, run_id = p["workdir"], safe_run_id(p["run_id"])
    os.makedirs(commit_dir(workdir), exist_ok=True)
    write_atomic(
        marker_path(workdir, run_id), str(p.get("reason") or "aborted by dflashctl") + "\n"
    )
    return {"marked": True}


def barrier_params(p, mode, **more):
    c = p["commit"]
    given = {k: c[k] for k in ("world", "rank", "names", "address", "port", "run_id", "deadline_s")}
    if "ack_wait_s" in c:  # tests only (ops/launch_command.py's ACK_WAIT_ENV)
        given["ack_wait_s"] = c["ack_wait_s"]
    return dict(
        given,
        same_release=bool(c.get("same_release")),
        mode=mode,
        marker=marker_path(p["workdir"], c["run_id"]),
        **more,
    )


def spawn(p, python, args, **pipes):
    """The barrier program with `args`, in its own session (a hangup of ours must not
    end it). The deploy's secret, which every key in the store carries, goes in its
    environment and not on its command line (anyone reads those in /proc)."""
    c = p["commit"]
    return subprocess.Popen(
        [python, "-c", c["program"], json.dumps(args)],
        start_new_session=True,
        env=dict(os.environ, DFLASH_COMMIT_SECRET=c.get("secret") or ""),
        **pipes,
    )


class BarrierProcess:
    """The barrier's interpreter for this launch, spoken to a line at a time (stdin in,
    stdout out; stderr to a file, so no pipe fills while nobody reads it). It may be
    used from a forked child of the process that started it: nothing here waits for
    it as its parent would (its exit status cannot be had there)."""

    def __init__(self, proc, stderr):
        self.proc = proc
        self.stderr = stderr
        self.buffer = b""

    def send(self, message):
        """False when it is gone (its stdin is closed at the other end)."""
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode("utf-8"))
            self.proc.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def receive(self, timeout):
        """Its next line as a dict; None when it ended without one; raises
        subprocess.TimeoutExpired when none came in `timeout` seconds."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.proc.args, timeout)
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line.decode("utf-8", "replace"))

    def last_error(self):
        try:
            self.stderr.seek(0)
            lines = self.stderr.read().decode("utf-8", "replace").strip().splitlines()
        except (OSError, ValueError):
            return None
        return lines[-1] if lines else None

    def close(self):
        """Our end of its stdin: once no process holds it, it reads the end and goes on
        (before a release: it ends without arriving; at the gate: not stopped here)."""
        try:
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass


def start(p, python, **more):
    """The barrier for this launch, in its own session (like the detached launch that
    talks to it: a hangup of ours must not end it). A commit is followed by the stop
    gate, waited for up to the stop's grace and a minute more."""
    gate_s = float(p.get("grace_s", 10.0)) + GATE_SLACK_S
    args = barrier_params(p, "join", gate=True, gate_s=gate_s, launch_s=LAUNCH_WAIT_S, **more)
    stderr = tempfile.TemporaryFile()
    proc = spawn(p, python, args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
    return BarrierProcess(proc, stderr)


def prestart(p):
    """Start the barrier's interpreter while the release is built: it imports torch
    (seconds, tens of them on a loaded host), then waits for the release on its stdin
    (`join(..., warm=)`). None without a commit, or when it cannot be started (the
    barrier then starts at the join, as before)."""
    if not p.get("commit"):
        return None
    try:
        return start(p, p["command"][0], wait_for_release=True)
    except OSError:
        return None


def cancel(warm):
    """This process will not send the release: close our end of the started-ahead
    barrier's stdin. It ends without arriving once no process holds that end (a forked
    launch that holds it still sends the release first)."""
    if warm is not None:
        warm.close()


def _arrive(p, python, release, warm):
    """The barrier that arrives with `release`: the one started ahead when it takes
    the release (any interpreter with torch will do), else one started now. A barrier
    that took the release is never started again: it may have arrived."""
    if warm is not None and warm.send({"release": release}):
        return warm
    cancel(warm)
    return start(p, python, release=release)


def join(p, python, release, warm=None):
    """Wait at the barrier, about to launch `release`. On commit, returns the barrier,
    to be passed to `pass_gate` once this node's old run is stopped; raises
    CommitAborted on abort. `warm`: the barrier `prestart` started, if any."""
    c = p["commit"]
    barrier = None
    try:
        barrier = _arrive(p, python, release, warm)
        answer = barrier.receive(float(c["deadline_s"]) + SLACK_S)
        if answer is None:
            raise ValueError("no answer")
    except subprocess.TimeoutExpired:
        barrier.kill()
        answer = {"decision": "abort", "in_doubt": True, "reason": "the commit barrier hung"}
    except (OSError, ValueError):
        last = barrier.last_error() if barrier is not None else None
        answer = {
            "decision": "abort",
            # It fails at its start (no torch there, say): before it could arrive.
            "in_doubt": False,
            "reason": f"the commit barrier could not run with {python}: {last or 'no answer'}",
        }
    finally:
        remove_file(marker_path(p["workdir"], c["run_id"]))
    if answer.get("decision") == "commit":
        return barrier
    if barrier is not None:
        barrier.close()
    reason = answer.get("reason") or "aborted"
    if answer.get("in_doubt"):
        raise CommitAborted(
            f"in doubt, so not launched here: {reason}; nothing was stopped on this node",
            "check every node with `dflashctl runs`, then deploy again",
            in_doubt=True,
        )
    raise CommitAborted(
        f"aborted: {reason}; nothing was stopped, the old run goes on",
        "fix what the error names, then deploy again",
    )


def pass_gate(barrier, stopped, grace_s):
    """After the commit and this node's stop: wait until every node has stopped its old
    run (`stopped` False: ours did not stop; the others are not held for it, and learn
    in the launch round that this node did not launch). The gate's answer, e.g.
    {"gate": "open"}; a gate that did not open is launched through all the same: the
    commit stands, and the launch round says whether the run formed everywhere."""
    if stopped:
        barrier.send({"stopped": True})
    else:
        barrier.close()
    return answer_of(barrier, float(grace_s) + GATE_SLACK_S, "gate")


def report_launch(barrier, launched, why=None):
    """The launch round: say whether this node's new run started; returns whether every
    node's did ({"launch": "all"}), or which could not ({"launch": "failed", "failed":
    [{"node", "why"}]}: every node then rolls back, through `pass_rollback`), or that
    the barrier could not tell ("timeout", "lost": the run stays as launched)."""
    barrier.send({"launched": bool(launched), "why": why})
    answer = answer_of(barrier, LAUNCH_WAIT_S, "launch")
    if answer.get("launch") != "failed":
        barrier.close()  # nothing more to say: it acks and ends
    return answer


def pass_rollback(barrier, grace_s):
    """After a failed launch round, once this node's new run is down: wait until every
    node's is, before the previous release is launched again (an old rank must not join
    a new run's store on its way out). The gate's answer, e.g. {"rollback": "open"}."""
    barrier.send({"unlaunched": True})
    barrier.close()
    return answer_of(barrier, float(grace_s) + GATE_SLACK_S, "rollback")


def answer_of(barrier, within_s, name):
    """The barrier's next answer, waited for `within_s` and SLACK_S more; {name:
    "lost"} when it ended or went silent."""
    try:
        answer = barrier.receive(within_s + SLACK_S)
    except (subprocess.TimeoutExpired, OSError, ValueError):
        answer = None
    return answer or {name: "lost", "why": "the commit barrier ended"}


def failed_nodes(outcome):
    """`node b (no space left on device)`, for each node the launch round names."""
    return ", ".join(f"node {f['node']} ({f['why']})" for f in outcome.get("failed") or [])


def signal_abort(p, reason):
    """This node failed before it arrived: tell the barrier in the background (the
    answer to the client does not wait for it). Best effort."""
    c = p.get("commit")
    if not c:
        return
    try:
        os.makedirs(commit_dir(p["workdir"]), exist_ok=True)
        who = c["names"][int(c["rank"])]
        args = barrier_params(p, "abort", reason=f"node {who} failed: {reason}")
        quiet = subprocess.DEVNULL
        child = spawn(p, p["command"][0], args, stdin=quiet, stdout=quiet, stderr=quiet)
        with open(holder_path(p["workdir"], c["run_id"]), "w", encoding="utf-8") as f:
            f.write(str(child.pid))
    except OSError:
        pass  # the others abort at their deadline, or when the client calls `abort`


def clear_leftovers(workdir, run_id):
    """Before a new attempt: the abort markers of earlier ones, and a background abort
    still holding the commit port (node 0 keeps it up for the others to read)."""
    folder = commit_dir(workdir)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(run_id + "."):
            continue
        path = os.path.join(folder, name)
        if name.endswith(".pid"):
            kill_holder(path, name[: -len(".pid")])
        remove_file(path)


def kill_holder(path, run_id):
    """End a background abort of run `run_id`, if that is still what the pid is (its
    command line names the run)."""
    try:
        with open(path, encoding="utf-8") as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if run_id.encode("utf-8") not in f.read():
                return  # it ended, and the pid is someone else's now
        os.killpg(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass  # it ended already
