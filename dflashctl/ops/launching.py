"""What deploy and restart share: the launch parameters the agent's `launch` and
`deploy` verbs take, the stop-and-launch call, and how stopped and launched runs are
reported and followed."""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from dflashctl import hints
from dflashctl.config.schema import Config
from dflashctl.errors import HostError
from dflashctl.ops import recovery, setup_env

# Deploy and restart stop runs as `stop` does (stopping.py, which `stop` imports alone);
from dflashctl.ops.stop import describe_stopped, process_scope
from dflashctl.remote import agent_client
from dflashctl.remote.agent_messages import (
    LaunchAnswer,
    LaunchParams,
    ProcessToStop,
    Resume,
)
from dflashctl.remote.connect import open_target
from dflashctl.reporting import SILENT, Reporter

if TYPE_CHECKING:
    from dflashctl.crash import Rule
    from dflashctl.remote.deploy_target import Target
    from dflashctl.remote.nodes import Node


def git_state(source: Path) -> dict[str, Any]:
    """The source's git commit and whether it has uncommitted changes (if in git)."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", "-C", str(source), *args], capture_output=True, text=True, timeout=10
        )

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {}
        status = git("status", "--porcelain", "--", ".")
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {"git_commit": head.stdout.strip(), "git_dirty": bool(status.stdout.strip())}


def config_meta(config: Config) -> dict[str, Any]:
    """Which config launched a run (recorded in its meta.json)."""
    return {"config_digest": config.digest, "config_path": str(config.path)}


# How long a `--wait` deploy or restart may queue behind another before the call gives up.
QUEUED_WAIT_S = 24 * 3600


def trainer_command(config: Config, extra_args: list[str]) -> list[str]:
    return [config.container.python, config.trainer.entry, *config.trainer.args, *extra_args]


def hang_env(config: Config) -> dict[str, str]:
    """The run's hang threshold, for the trainer's own watchdog (it dumps every
    thread's stack when its steps stop at the threshold `status` and `logs` use)."""
    hang = config.run.hang
    return {"DFLASH_HANG_FACTOR": f"{hang.factor:g}", "DFLASH_HANG_MIN_S": f"{hang.min_s:g}"}


def launch_params(
    config: Config,
    run_id: str,
    release: str | None,
    command: list[str],
    meta: dict[str, Any],
    *,
    fresh: bool = False,
    by: str = "deploy",
    wait: bool = False,
) -> LaunchParams:
    gpus = config.run.gpus
    return {
        "fresh": fresh,
        "by": by,
        # Who holds the workdir's lock while this command runs: said to anyone refused.
        "holder": {"command": by, "machine": socket.gethostname(), "pid": os.getpid()},
        "wait": wait,
        "workdir": config.container.workdir,
        "release": release,
        "run_id": run_id,
        "entry": config.trainer.entry,
        "scope": process_scope(config),
        "command": command,
        "env": {
            **hang_env(config),
            **config.trainer.env,
            **({"DFLASH_ON_EXIT": config.run.on_exit} if config.run.on_exit else {}),
            # run.gpus: the run sees only those GPUs (renumbered from 0 inside it).
            **({} if gpus is None else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}),
        },
        "grace_s": config.run.stop_grace_s,
        "keep_releases": config.run.keep_releases,
        "meta": dict(meta, hang=config.run.hang.model_dump(), gpus=gpus),
        "supervisor": recovery.supervisor_program(),
        "recovery": recovery.recovery_settings(config),
        # The venv the run starts from (agent/venvs.py): made by the launch if missing.
        "setup": setup_env.setup_params(config),
    }


def launch_timeout(params: LaunchParams, base: float) -> float:
    """A launching call's timeout: `base` and the stop's grace, plus what the agent may
    wait for: a deploy in flight (--wait), the venv it makes when it is missing, the
    other nodes at the commit barrier (agent/commit.py's slack too)."""
    timeout = base + float(params["grace_s"]) + (QUEUED_WAIT_S if params.get("wait") else 0)
    if params.get("setup"):
        timeout += float(params["setup"]["timeout_s"])
    if params.get("commit"):
        timeout += float(params["commit"]["deadline_s"]) + 300
    return timeout


def stop_and_launch(config: Config, target: Target, params: LaunchParams) -> LaunchAnswer:
    """Stop stale runs and launch `params["release"]` (None: the current one) in one
    round trip: a deploy with nothing to send, and restart."""
    try:
        answer = agent_client.call_agent(
            target, config.container.python, "launch", params, timeout=launch_timeout(params, 120)
        )
        return cast(LaunchAnswer, answer)
    except HostError as exc:
        if params.get("release"):
            exc.hint = exc.hint or (
                f"release {params['release']} is unpacked in {config.container.workdir}/releases; "
                f"{hints.command('restart')} launches the current release again"
            )
        raise


def describe_target_to_stop(item: ProcessToStop) -> str:
    who = f"run {item['run_id']}" if item.get("run_id") else "hand-started"
    scope = "its process group" if item.get("group") else "the process and its children"
    return f"pid {item['pid']} ({who}, {scope}): {item.get('cmdline', '')}"


def planned_train_steps(command: list[str], source: Path | None) -> int | None:
    """train.steps as the trainer will read it from `command`: its last `--set
    train.steps=N`, else the `--config` file's (read from `source`, the tree being
    deployed). None when that cannot be known here: train.epochs decides, no such
    setting, another trainer's arguments, or a file that is not the one that runs
    (a restart relaunches the release in the container: `source` None)."""
    config_file, steps, unknown = None, None, False
    args = list(command)
    for index, arg in enumerate(args):
        value = args[index + 1] if index + 1 < len(args) else ""
        if arg.startswith("--set="):
            arg, value = "--set", arg.removeprefix("--set=")
        elif arg.startswith("--config="):
            arg, value = "--config", arg.removeprefix("--config=")
        if arg == "--config":
            config_file = value
        elif arg == "--set":
            key, _, text = value.partition("=")
            if key.strip() == "train.steps":
                text = text.strip()
                steps, unknown = (int(text), False) if text.isdigit() else (None, True)
            elif key.strip() == "train.epochs":
                unknown = unknown or text.strip().lower() not in ("null", "none", "~", "")
    if unknown:
        return None
    if source is None or not config_file:
        return steps
    try:
        import yaml

        loaded = yaml.safe_load((source / config_file).read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return steps
    train = loaded.get("train") if isinstance(loaded, dict) else None
    if isinstance(train, dict) and train.get("epochs") is not None:
        return None  # the trainer counts steps from the data then
    if steps is not None or not isinstance(train, dict):
        return steps
    value = train.get("steps")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def describe_start(
    resume: Resume | None,
    previous: str | None,
    *,
    fresh: bool | None,
    train_steps: int | None = None,
) -> str:
    """Where a new run's training starts: said the same by the dry run (what would
    happen) and the launch (what did). `fresh` None: not known (an older agent).
    `train_steps`: the trainer's train.steps (planned_train_steps), None if unknown."""
    if fresh:
        kept = f"; run {previous}'s checkpoints are kept" if previous else ""
        return f"starts at step 0 (--fresh){kept}"
    if resume and resume.get("finished"):
        step = resume.get("step")
        at = f" at step {step}" if step is not None else ""
        if train_steps is not None and step is not None and train_steps > step:
            return (
                f"continues run {resume['run_id']}{at} from {resume['checkpoint']}: it "
                f"finished there, and train.steps is now {train_steps}"
            )
        if train_steps is not None and step is not None:
            return (
                f"starts a new training at step 0, as run {resume['run_id']} finished{at} "
                f"and train.steps is {train_steps}"
            )
        more = f"above {step}" if step is not None else "raised"
        return (
            f"starts a new training at step 0, as run {resume['run_id']} finished{at} "
            f"(dflashctl cannot read the trainer's train.steps: if it is now {more}, "
            "the run continues that checkpoint instead)"
        )
    if resume:
        step = "" if resume.get("step") is None else f" at step {resume['step']}"
        return (
            f"continues run {resume['run_id']}{step} from {resume['checkpoint']} "
            f"({hints.command('deploy --fresh')} starts at step 0)"
        )
    if previous:
        return f"starts at step 0 (run {previous} left no checkpoint to continue from)"
    return "starts at step 0"


def say_every_launch(
    report: Reporter,
    nodes: list[Node],
    answers: list[LaunchAnswer],
    params: dict[int, LaunchParams],
    since: float,
    *,
    deployed: bool = False,
) -> tuple[dict[str, Any], list[list[str]]]:
    """On each node, the runs the agent stopped, then the one it launched and where its
    training starts (`since`: when the stop and launch began; `deployed`: the trainer
    tree here is the one launched, its train.steps known); returns the run's part of
    the summary, and each node's command as the agent ran it."""
    from dflashctl.remote.nodes import names_each_node

    run_id = params[nodes[0].index]["run_id"]
    commands = []
    for node, launched in zip(nodes, answers, strict=True):
        prefix = f"{node.name}: " if names_each_node(nodes) else ""
        command = launched["run"].get("command") or params[node.index]["command"]
        stop_s = float(launched.get("stop_seconds") or 0.0) if launched["stopped"] else 0.0
        for index, item in enumerate(launched["stopped"]):
            report.done(prefix + describe_stopped(item), stop_s if index == 0 else 0.0)
        report.done(
            f"{prefix}launched run {run_id} (pid {launched['run']['pid']}) from release "
            f"{launched['release']}: {shlex.join(command)}",
            max(time.monotonic() - since - stop_s, 0.0),
        )
        run = launched["run"]
        steps = planned_train_steps(command, Path(node.config.trainer.source) if deployed else None)
        start = describe_start(
            run.get("resume"), run.get("previous_run"), fresh=run.get("fresh"), train_steps=steps
        )
        # An agent that does not say where it resumed: step 0.
        report.info(f"  {start if 'resume' in run else 'starts at step 0'}")
        commands.append(command)
    resume = answers[0]["run"].get("resume")
    top = {
        "run_id": run_id,
        "release": answers[0]["release"],
        "resumed_from": resume["run_id"] if resume else None,
        "resumed_step": resume.get("step") if resume else None,
        "resumed_checkpoint": resume["checkpoint"] if resume else None,
        "replaced_run": answers[0]["run"].get("previous_run"),
    }
    return top, commands


# --------------------------------------------------------------------------- following


def import_follower() -> None:
    """Import the follower (and the crash engine) before the run starts, for a deploy
    or restart that follows it: a Ctrl-C while the run is followed must not land
    inside an import (one that did ended the CLI by the signal, exit -2, after it had
    said "interrupted"). A detached one never imports them (a fifth of the CLI's
    imports: bench_transfer.py --only one-file)."""
    import dflashctl.follow  # noqa: F401


# The bundled trainer's line once every rank is past the rendezvous (World.started in
# trainer/dflash/pipeline/distributed.py), and the word its entry script names to say
# it prints one: a trainer that does not is not waited for (it would never say it).
BUNDLED_START_LINE = r"^rendezvous: "
START_GATE_WORD = "DFLASH_START_GATE"


def start_line(config: Config) -> str | None:
    """The line (a regex) a detached deploy or restart waits for on every node before
    it says the run started: run.start_line, else the bundled trainer's where the entry
    script names DFLASH_START_GATE; None: it says "launched" at once."""
    if config.run.start_timeout_s <= 0:
        return None
    if config.run.start_line:
        return config.run.start_line
    entry = Path(config.trainer.source) / config.trainer.entry
    try:
        text = entry.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return BUNDLED_START_LINE if START_GATE_WORD in text else None


def follow_unless_detached(
    nodes: list[Node],
    rules: list[Rule],
    summary: dict[str, Any],
    *,
    detach: bool,
    report: Reporter = SILENT,
) -> tuple[int, dict[str, Any]]:
    """Follow the new run on every node as `logs --follow` does
    (dflashctl/follow/fleet.py); (exit code, summary with the run's result: one node's,
    or each node's and the root cause). Detached: wait for its start line on every node
    (start_line; dflashctl/follow/start_gate.py), the crash reported if it died first."""
    run_id = summary["run_id"]
    line = start_line(nodes[0].config) if detach else None
    if detach and line is None:
        report.info(f"follow it with {hints.command(f'logs -f {run_id}')}")
        return 0, summary
    if detach:
        from dflashctl.follow.start_gate import WAITING_FOR, wait_for_start

        timeout = nodes[0].config.run.start_timeout_s
        with report.busy(f"waiting for run {run_id} to start ({WAITING_FOR})"):
            outcome = wait_for_start(nodes, run_id, rules=rules, line=line, timeout_s=timeout)
        summary["start"] = outcome.to_json()
        if outcome.status in ("died", "ended"):
            summary["result"] = outcome.result.to_json()
        return outcome.report(), summary
    from dflashctl.follow import follow_fleet, report_fleet  # (import_follower)

    result = follow_fleet(nodes, run_id, rules=rules, from_offset=0)
    summary["result"] = result.to_json()
    return report_fleet(result), summary


# --------------------------------------------------------------------------- Ctrl-C


def what_interrupt_left(config: Config, run_id: str, grace_s: float) -> str:
    """Ctrl-C during a deploy or restart: what it left, to say. The container-side
    launch runs on without us once it began, so ask the workdir (a fresh connection)
    after it settled: the new run launched, or the old one still running."""
    try:
        target = open_target(config)
        try:
            answer = agent_client.call_agent(
                target,
                config.container.python,
                "settle",
                {"workdir": config.container.workdir, "run_id": run_id, "wait_s": grace_s + 60},
                timeout=grace_s + 120,
            )
        finally:
            target.close()
    except (HostError, KeyboardInterrupt) as exc:
        reason = exc.message if isinstance(exc, HostError) else "interrupted again"
        return (
            f"interrupted; could not learn what the deploy left ({reason}): "
            f"{hints.command('runs')} shows which run is running"
        )
    launched, active = answer.get("launched"), answer.get("active_run")
    if launched is not None:
        return (
            f"interrupted, but the launch had begun and finished in the container: run "
            f"{run_id} launched (pid {launched.get('pid')}), release {answer.get('release')}; "
            f"follow it with {hints.command(f'logs -f {run_id}')}"
        )
    if answer.get("busy"):
        return (
            "interrupted; the container is still stopping the old run and launching: "
            f"{hints.command('runs')} shows the outcome shortly"
        )
    if active is not None and active.get("status") == "running":
        return (
            f"interrupted before anything was stopped: run {active['id']} still running "
            f"(release {answer.get('release')}); nothing changed"
        )
    if active is not None:
        return (
            f"interrupted: run {run_id} was not launched; the last run {active['id']} "
            f"is {active.get('status')} and nothing is running; deploy again"
        )
    return "interrupted before anything was launched; nothing is running"


@contextlib.contextmanager
def interrupt_said(report: Reporter, nodes: list[Node], run_id: str, params) -> Iterator[None]:
    """On a Ctrl-C, what it left on each node (headed by the node's name when there are
    several), told to `report`: deploy's and restart's one way of saying it."""
    from dflashctl.remote.nodes import names_each_node

    try:
        yield
    except KeyboardInterrupt:
        for node in nodes:
            left = what_interrupt_left(node.config, run_id, float(params[node.index]["grace_s"]))
            report.warning(f"{node.name}: {left}" if names_each_node(nodes) else left)
        raise
