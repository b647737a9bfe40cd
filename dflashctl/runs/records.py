"""Training runs in the workdir: ids, records and their real state.

A run lives in `workdir/runs/<run-id>/` (train.log, pid, exit_code, meta.json);
`workdir/active_run` names the one launched last. The state comes from the pid and
exit_code files and the process table where the trainer runs, never from the log:
one agent call (the `runs` verb, dflashctl/agent/verbs.py) reads them all.

    running   the wrapper's pid is alive and no exit code yet
    exited    exit_code N < 128 (the trainer returned N)
    killed    exit_code 128+N: the trainer died from signal N
    stopped   a dflashctl command (deploy, restart, stop) stopped it: recorded in the
              run's stopped.json before the signal went, with when and its successor
    lost      no exit code and no process (the container restarted, or the wrapper
              was killed from outside)
"""

from __future__ import annotations

import secrets
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from dflashctl import hints
from dflashctl.agent.progress import describe as describe_hang
from dflashctl.errors import HostError
from dflashctl.remote.agent_client import call_agent
from dflashctl.remote.agent_messages import PruneAnswer, PrunedRun, RunRecord, RunsAnswer

if TYPE_CHECKING:
    from dflashctl.remote.deploy_target import Target

DEFAULT_PYTHON = "python3"


def new_id() -> str:
    """A run or release id, `20261129-101502-a1b2`: sorts by UTC time, unique enough
    for one workdir."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class RunState:
    status: str  # "running" | "exited" | "killed" | "stopped" | "lost"
    exit_code: int | None = None
    signal: int | None = None
    stopped: dict[str, Any] | None = None  # status "stopped": {"by", "at", "replaced_by"}

    @property
    def finished(self) -> bool:
        return self.status != "running"

    @property
    def ok(self) -> bool:
        """Ended without a fault: finished with exit 0, or stopped on purpose."""
        return (self.status == "exited" and self.exit_code == 0) or self.status == "stopped"

    def describe(self, category: str | None = None) -> str:
        """The outcome in words, the same in `runs`, `status` and `logs`: `running`,
        `finished (exit 0)`, `crashed (exit 1, thread_exception)`, `crashed (killed by
        SIGKILL)`, `stopped by deploy at ...`, `lost`. `category`: the crash's, when the
        run's supervisor recorded one."""
        if self.status == "stopped":
            return describe_stop(self.stopped or {})
        if self.status == "exited":
            how = f"exit {self.exit_code}"
        elif self.status == "killed":
            how = f"killed by {signal_name(self.signal)}"
        else:
            return self.status
        if self.outcome == "finished":
            return f"finished ({how})"
        return f"crashed ({how}, {category})" if category else f"crashed ({how})"

    @property
    def outcome(self) -> str:
        """running | finished (ended by itself, exit 0) | crashed (non-zero, or a signal
        nobody of ours sent) | stopped (by a dflashctl command) | lost."""
        if self.status in ("running", "stopped", "lost"):
            return self.status
        return "finished" if self.ok else "crashed"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "status": self.status,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "signal": self.signal,
        }
        if self.stopped is not None:
            data["stopped"] = self.stopped
        return data


def describe_stop(stopped: dict[str, Any]) -> str:
    """`stopped by deploy at 2026-11-30T18:02:11Z, replaced by run 20261130-...`."""
    text = f"stopped by {stopped.get('by') or 'dflashctl'}"
    if stopped.get("at"):
        text += f" at {stopped['at']}"
    if stopped.get("replaced_by"):
        text += f", replaced by run {stopped['replaced_by']}"
    return text


@dataclass
class RunInfo:
    id: str
    state: RunState
    pid: int | None = None
    release: str | None = None
    started: str | None = None
    command: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    active: bool = False  # the run workdir/active_run names (launched last)
    # The supervisor's attempts.json (run.retry): {"max_attempts", "attempts": [...]}.
    attempts: dict[str, Any] | None = None
    bytes: int | None = None  # the run's folder on disk (asked by `runs` only)
    # While it runs: its step progress, judged by the agent (dflashctl/agent/progress.py).
    progress: dict[str, Any] | None = None
    # The step its trainer's first start record names (None: none written yet).
    started_at_step: int | None = None

    @property
    def continued(self) -> bool | None:
        """Did it continue the run it was handed (meta's `resumed_from`)? False for a
        new training at step 0 (after a finished run); None while not known."""
        meta = self.meta
        if not meta.get("resumed_from"):
            return False
        if self.started_at_step is not None:
            return self.started_at_step > 0 or not meta.get("resumed_step")
        return None if meta.get("resumed_finished") else True

    @property
    def hanging(self) -> bool:
        return self.state.status == "running" and bool((self.progress or {}).get("hanging"))

    @property
    def recovery(self) -> str | None:
        return describe_attempts(self.attempts, running=self.state.status == "running")

    @property
    def crash_category(self) -> str | None:
        """The category the supervisor's crash detector gave the last attempt, if any."""
        items = (self.attempts or {}).get("attempts") or []
        category = items[-1].get("category") if items else None
        return str(category) if category else None

    @property
    def clean_stop(self) -> str | None:
        """`stopped (checkpoint at step 11)`: the run's supervisor found that the trainer
        stopped as it was asked (SIGTERM, Ctrl-C), whatever its exit status."""
        items = (self.attempts or {}).get("attempts") or []
        last = items[-1] if items else {}
        if self.state.status in ("exited", "killed") and last.get("reason") == "stopped":
            return last.get("stop") or None
        return None

    @property
    def hung(self) -> str | None:
        """What the hang was, when the run was stopped while it hung (the supervisor's
        record of its last attempt): a stop after a hang does not make it a clean stop."""
        said = (self.state.stopped or {}).get("hung")  # the stop found it hanging
        if said:
            said = str(said)
            return said[len("hanging: ") :] if said.startswith("hanging: ") else said
        items = (self.attempts or {}).get("attempts") or []
        last = items[-1] if items else {}
        if self.state.status != "running" and last.get("category") == "hang":
            return str(last.get("summary") or "hang")
        return None

    def describe_state(self) -> str:
        """`running, attempt 2/4, resumed at step 18400 after nccl_timeout`."""
        if self.hung:
            return f"hung ({self.hung}), then {self.clean_stop or self.state.describe()}"
        if self.clean_stop:
            return self.clean_stop
        note = self.recovery
        text = self.state.describe(self.crash_category) + (f", {note}" if note else "")
        hang = describe_hang(self.progress) if self.hanging else None
        return text + (f", {hang}" if hang else "")

    def short_state(self) -> str:
        """The `runs` table's cell: `crashed (exit 1)`, `running, attempt 2/4, ...,
        hanging`, `hung (no step finished for 64 s ...), then stopped`; the crash's
        category, why it was not retried and how long a hang has lasted are `runs
        show`'s (describe_state)."""
        if self.hung:
            # A stop that ended a hang is no clean stop: the table says what it was.
            return f"hung ({self.hung}), then {self.state.outcome}"
        if self.clean_stop:
            return self.clean_stop
        note = describe_attempts(self.attempts, running=self.state.status == "running", brief=True)
        text = self.state.describe() + (f", {note}" if note else "")
        return text + (", hanging" if self.hanging else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "release": self.release,
            "started": self.started,
            "pid": self.pid,
            "state": self.describe_state()
            if self.hung
            else self.clean_stop or self.state.describe(self.crash_category),
            "category": "hang"
            if self.hung
            else self.crash_category
            if self.state.outcome == "crashed" and not self.clean_stop
            else None,
            "hung": self.hung,
            **self.state.to_json(),
            "command": self.command,
            "meta": self.meta,
            "continued": self.continued,
            "recovery": self.recovery,
            "bytes": self.bytes,
            "attempts": (self.attempts or {}).get("attempts") or [],
            "hanging": self.hanging,
            "hang": describe_hang(self.progress) if self.hanging else None,
            "progress": self.progress,
        }


def describe_attempts(
    attempts: dict[str, Any] | None, *, running: bool, brief: bool = False
) -> str | None:
    """The run's attempts as one lineage, for `runs` and `status`:
    `attempt 2/4, resumed at step 18400 after nccl_timeout` while it runs,
    `attempt 2/4, after recovering from killed` once it ended, plus
    `not retried: <why>` when a crash ended it (not when `brief`). None for a run of one attempt that
    ended by itself or was stopped (nothing to say)."""
    items = list((attempts or {}).get("attempts") or [])
    if not items:
        return None
    most = (attempts or {}).get("max_attempts")
    last = items[-1]

    def numbered(n: int) -> str:
        # Past the limit (restarts older than run.retry.window_s no longer count): `6`.
        return f"{n}/{most}" if most and n <= most else str(n)

    if last.get("retried"):
        at = last.get("resume_step")
        where = f"resumed at step {at}" if at is not None else "restarted"
        text = f"attempt {numbered(last['attempt'] + 1)}, {where} after {last.get('category')}"
        return text if running else text + " (ended before it reported)"
    recovered = [a.get("category") for a in items if a.get("retried")]
    notes = []
    if recovered:
        notes.append(f"attempt {numbered(last['attempt'])}")
        notes.append("after recovering from " + ", ".join(dict.fromkeys(map(str, recovered))))
    if last.get("reason") not in (None, "finished", "stopped") and not brief:
        notes.append(f"not retried: {last['reason']}")
    return ", ".join(notes) or None


def signal_name(number: int | None) -> str:
    if number is None:
        return "a signal"
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _run_from_agent(record: RunRecord, active_id: str | None) -> RunInfo:
    meta = dict(record.get("meta") or {})
    return RunInfo(
        id=record["id"],
        state=RunState(
            record["status"], record.get("exit_code"), record.get("signal"), record.get("stopped")
        ),
        pid=record.get("pid") if record.get("pid") is not None else meta.get("pid"),
        release=meta.get("release"),
        started=meta.get("started"),
        command=list(meta.get("command") or []),
        meta=meta,
        active=record["id"] == active_id,
        attempts=record.get("attempts"),
        bytes=record.get("bytes"),
        progress=record.get("progress"),
        started_at_step=record.get("started_at_step"),
    )


# --------------------------------------------------------------------------- queries


def _runs(target: Target, python: str, params: dict[str, str]) -> RunsAnswer:
    return cast(RunsAnswer, call_agent(target, python, "runs", params))


def list_runs(
    target: Target, workdir: str, *, python: str = DEFAULT_PYTHON, sizes: bool = False
) -> list[RunInfo]:
    """Every run in the workdir, oldest first, each with its real state (and, with
    `sizes`, what its folder takes on disk)."""
    params: dict[str, Any] = {"workdir": workdir}
    if sizes:
        params["sizes"] = True
    answer = _runs(target, python, params)
    return [_run_from_agent(r, answer.get("active_run")) for r in answer["runs"]]


def active_run(target: Target, workdir: str, *, python: str = DEFAULT_PYTHON) -> RunInfo | None:
    """The run launched last (whatever its state now), or None if none ever was."""
    return active_run_and_release(target, workdir, python=python)[0]


def active_run_and_release(
    target: Target, workdir: str, *, python: str = DEFAULT_PYTHON
) -> tuple[RunInfo | None, str | None]:
    """The run launched last and the release `current` points at (None: none yet),
    in one round trip."""
    answer = _runs(target, python, {"workdir": workdir, "run_id": _ACTIVE})
    runs = answer["runs"]
    run = _run_from_agent(runs[0], answer.get("active_run")) if runs else None
    return run, answer.get("release")


def get_run(target: Target, workdir: str, run_id: str, *, python: str = DEFAULT_PYTHON) -> RunInfo:
    run, _ = find_run(target, workdir, run_id, python=python)
    if run is None:
        raise HostError(
            f"no run {run_id} in {workdir}/runs",
            hint=f"list the runs with {hints.command('runs')}",
        )
    return run


def find_run(
    target: Target, workdir: str, run_id: str, *, python: str = DEFAULT_PYTHON
) -> tuple[RunInfo | None, str | None]:
    """(the run, or None where it does not exist; the workdir's active run id), in one
    round trip: every node of a run is asked this before it is followed."""
    answer = _runs(target, python, {"workdir": workdir, "run_id": run_id})
    active = answer.get("active_run")
    if not answer["runs"]:
        return None, active
    return _run_from_agent(answer["runs"][0], active), active


def run_state(
    target: Target, workdir: str, run_id: str, *, python: str = DEFAULT_PYTHON
) -> RunState:
    """The run's state right now (one round trip)."""
    return get_run(target, workdir, run_id, python=python).state


@dataclass
class PruneResult:
    removed: list[PrunedRun]  # oldest first
    spared: list[str]  # older than the newest N but active or running: kept
    runs: int  # how many runs there were
    dry: bool

    @property
    def bytes(self) -> int:
        return sum(int(r["bytes"]) for r in self.removed)


def prune_runs(
    target: Target,
    workdir: str,
    keep: int,
    *,
    dry: bool,
    only: list[str] | None = None,
    python: str = DEFAULT_PYTHON,
) -> PruneResult:
    """Remove (or with dry, list) the ended runs beyond the newest `keep` (one round trip)."""
    params = {"workdir": workdir, "keep": keep, "dry": dry, "only": only}
    answer = cast(PruneAnswer, call_agent(target, python, "prune", params))
    return PruneResult(answer["removed"], answer["spared"], answer["runs"], answer["dry"])


# The agent resolves this placeholder to the id in workdir/active_run.
_ACTIVE = "@active"
