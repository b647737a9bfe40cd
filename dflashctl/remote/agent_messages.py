"""The agent's messages on the wire, typed: what each verb takes and answers.

They are plain JSON objects (the agent, stdlib-only and Python 3.6, builds them as
dicts in dflashctl/agent/verbs.py); these TypedDicts name their fields for the CLI.
"""

from __future__ import annotations

from typing import Any, TypedDict


class _ProcessToStop(TypedDict):
    kind: str  # "active" | "run" | "stale" | "member" (a run's process outside its group)
    run_id: str | None
    pid: int
    pgid: int | None
    group: bool  # the signal goes to the whole process group
    cmdline: str


class ProcessToStop(_ProcessToStop, total=False):
    """A run or hand-started trainer the agent would stop (the `inspect` verb's `to_stop`)."""

    pids: list[int]  # without a group: the process and its children


class _StoppedProcess(ProcessToStop):
    ended: str  # "terminated" | "killed" | "still running after SIGKILL"


class StoppedProcess(_StoppedProcess, total=False):
    """How one of them ended."""

    seconds: float
    exit_code: int | None


class Expectation(TypedDict):
    """What this machine deployed last: the agent checks it is still so."""

    release: str
    manifest: dict[str, list]


class _LaunchParams(TypedDict):
    workdir: str
    release: str | None  # None: the current release
    run_id: str
    entry: str
    scope: str  # "container" | "workdir"
    command: list[str]
    env: dict[str, str]
    grace_s: float
    keep_releases: int
    meta: dict[str, Any]
    supervisor: str  # runs/<id>/supervise.py (dflashctl/ops/recovery.py)
    recovery: dict[str, Any]  # run.retry and the crash rules, for the supervisor


class LaunchParams(_LaunchParams, total=False):
    """The `launch` verb's parameters; `deploy` takes them plus the build's."""

    expect: Expectation
    fresh: bool  # start at step 0 instead of continuing the replaced run's training
    by: str  # the dflashctl command that stops the old run: "deploy" | "restart"
    holder: dict[str, Any]  # {"command", "machine", "pid"}: named to a deploy refused meanwhile
    wait: bool  # queue behind a deploy in flight instead of being refused
    setup: dict[str, Any] | None  # config.setup for the run's venv (ops/setup_env.py); None: none
    # Several nodes: where and how long to agree first (ops/launch_command.py, agent/commit.py)
    commit: dict[str, Any]
    # deploy only
    archive: str  # "-": the archive follows the agent's program on its stdin
    archive_size: int  # its bytes, all of which must arrive
    manifest_sha256: str  # of the archive's first member (the release's manifest)
    base: str | None
    upload_prefix: str  # uploads of earlier versions left in /tmp, removed once stale


class Resume(TypedDict):
    """Where a new run continues: the replaced run's latest complete checkpoint."""

    run_id: str
    checkpoint: str
    step: int | None
    finished: bool  # the end of a run that finished: continued only with steps left


class _StartedRun(TypedDict):
    id: str
    pid: int
    run_dir: str
    started: str


class StartedRun(_StartedRun, total=False):
    resume: Resume | None  # None: starts at step 0
    previous_run: str | None  # the run it replaces (the active one before)
    fresh: bool  # --fresh: starts at step 0 whatever the replaced run left
    command: list[str]  # the command as launched (the setup venv's python, if any)


class BuildAnswer(TypedDict):
    release: str
    files: int
    unpacked: int
    linked: int
    copied: int
    leftovers_removed: list[str]
    seconds: float


class InspectAnswer(TypedDict):
    python: str
    release: str | None
    manifest: dict[str, list] | None
    active_run: str | None
    to_stop: list[ProcessToStop]
    # Where a deploy now would continue (the active run's lineage), as launch decides it.
    continues: Resume | None


class _LaunchAnswer(TypedDict):
    stopped: list[StoppedProcess]
    stop_seconds: float
    launch_seconds: float
    release: str
    run: StartedRun
    releases_removed: list[str]


class LaunchAnswer(_LaunchAnswer, total=False):
    """The `launch` verb's answer; `deploy` adds `build`; a launch across nodes, the
    stop gate's answer (`{"gate": "open"}`, or why it launched without every node
    stopped: "timeout"/"closed" with `missing`, "lost" with `why`)."""

    build: BuildAnswer
    gate: dict[str, Any]
    check_seconds: float  # how long the launch waited for the trainer's config check


class StopAnswer(TypedDict):
    stopped: list[StoppedProcess]
    all_stopped: bool


class _RunRecord(TypedDict):
    id: str
    meta: dict[str, Any]
    pid: int | None
    status: str  # "running" | "exited" | "killed" | "stopped" | "lost"
    exit_code: int | None
    signal: int | None


class RunRecord(_RunRecord, total=False):
    stopped: dict[str, Any]  # status "stopped": {"by", "at", "replaced_by"}
    attempts: dict[str, Any] | None  # the supervisor's attempts.json (run.retry)
    # A running run's step progress (agent/progress.py): {"hanging", "last_step", ...}.
    progress: dict[str, Any] | None
    # A continued run: the step its trainer's first start record names (None: none yet).
    started_at_step: int | None


class RunsAnswer(TypedDict):
    active_run: str | None
    release: str | None
    runs: list[RunRecord]


class PrunedRun(TypedDict):
    id: str
    bytes: int
    status: str
    exit_code: int | None
    signal: int | None


class PruneAnswer(TypedDict):
    removed: list[PrunedRun]
    spared: list[str]
    runs: int
    dry: bool


class _LineagePart(TypedDict):
    id: str


class LineagePart(_LineagePart, total=False):
    """One run of a lineage: its record and metrics.jsonl records (None: no file), or
    `missing` when a resumed_from names a run that is gone."""

    missing: bool
    record: RunRecord
    metrics: list[dict[str, Any]] | None
    step_records: int  # step records in the file (more than sent when thinned out)


class RunMetrics(TypedDict):
    id: str
    lineage: list[LineagePart]  # oldest first, ending with the run asked about


class MetricsAnswer(TypedDict):
    runs: list[RunMetrics]
    missing: list[str]  # run ids asked about that are not there
    active_run: str | None
