"""deploy: the orchestration, in as few round trips as possible (restart and stop are
in stop_restart.py, what they share with deploy in launching.py).

A deploy is at most two commands over one SSH connection, each answered by the agent
(the package dflashctl/agent/, see agent_client.py) where the trainer runs:

  1. inspect   the current release's real manifest, the runs to stop   (read only)
  2. deploy    one `pct exec` of the agent: the archive of changed files follows the
               agent's program on its stdin and is unpacked as it arrives into
               releases/<id>.partial (unchanged files hard-linked from the current
               release), validated, renamed to releases/<id>; then the agent stops
               stale runs, swaps `current`, launches the run detached and records it

Step 1 is skipped when this machine remembers what it deployed there last (see
releases.LastDeploy): the agent then checks that release is still current and intact
before relying on it, and answers `stale` (changing nothing) when it is not.

Before anything is stopped the new release is complete and validated; `current`
moves only after the old run is gone. An interruption before the agent's stop step
leaves the old release current and the old run running; the next deploy removes
partial releases and abandoned uploads.
"""

from __future__ import annotations

import hashlib
import itertools
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer

from dflashctl import agent_client, hints, pct, releases, runs, setup_env, sync, terminal
from dflashctl.agent_messages import (
    InspectAnswer,
    LaunchAnswer,
    LaunchParams,
    ProcessToStop,
    Resume,
)
from dflashctl.archive import Archive
from dflashctl.config import Config
from dflashctl.connect import open_proxmox, session
from dflashctl.crash import rules_for
from dflashctl.errors import HostError, UsageError
from dflashctl.launching import (
    config_meta,
    describe_start,
    describe_target_to_stop,
    follow_unless_detached,
    git_state,
    launch_params,
    lineage_summary,
    print_launched,
    process_scope,
    report_interrupted,
    stop_and_launch,
    trainer_command,
)
from dflashctl.nodes import lone_node
from dflashctl.source_cache import SourceCache

if TYPE_CHECKING:
    from dflashctl.proxmox import ContainerStatus
    from dflashctl.target import Target

# How long a `--wait` deploy may queue behind another before the call gives up.
QUEUED_WAIT_S = 24 * 3600

# An upload nobody has written to for this long was abandoned by an interrupted deploy.
ABANDONED_UPLOAD_MIN = 1

# --------------------------------------------------------------------------- the target


def start_container(config: Config, target: Target) -> ContainerStatus:
    """Start the container through the Proxmox API (pvesh over this connection, or
    HTTPS with a token) and wait until it runs; returns its state."""
    from dflashctl import proxmox

    api = open_proxmox(config, target.transport)
    return proxmox.start_container(
        api, config.proxmox.node, target.vmid, timeout=config.proxmox.start_timeout_s
    )


def inspect(config: Config, target: Target, *, may_start: bool) -> InspectAnswer:
    """Round trip 1; starts a stopped container first when allowed (else exit 3)."""
    params = {
        "workdir": config.container.workdir,
        "entry": config.trainer.entry,
        "scope": process_scope(config),
    }
    try:
        return cast(
            InspectAnswer,
            agent_client.call_agent(target, config.container.python, "inspect", params),
        )
    except pct.ContainerNotRunning:
        if not may_start:
            raise  # with pct.not_running_hint, the one hint for a stopped container
    with terminal.step(f"starting container {target.vmid}") as step:
        status = start_container(config, target)
        step["done"] = f"started container {target.vmid}"
    if status.warnings:
        terminal.warning(f"container {target.vmid} started with warnings: {status.warnings}")
    return cast(
        InspectAnswer, agent_client.call_agent(target, config.container.python, "inspect", params)
    )


# --------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    manifest: sync.Manifest
    diff: sync.Diff
    base_release: str | None  # the release now current, if any
    new_release: str | None  # None: nothing changed, the current release is reused
    to_stop: list[ProcessToStop]
    command: list[str]
    fresh: bool = False  # the new run starts at step 0 (else it continues the replaced run)
    wait: bool = False  # queue behind a deploy in flight
    active_run: str | None = None  # the run a launch now replaces (known after inspecting)
    continues: Resume | None = None  # where its training stands (known after inspecting)

    @property
    def bytes_to_send(self) -> int:
        return sum(self.manifest[p][0] for p in self.diff.changed)

    @property
    def release(self) -> str | None:
        return self.new_release or self.base_release


def preflight(config: Config) -> tuple[sync.Manifest, int, sync.Skipped]:
    """The local checks that need no host: the tree (every file readable), the entry
    script, every .py compiles. Returns the manifest, how many .py files compile, and
    what trainer.exclude left out."""
    source = Path(config.trainer.source)
    cache = SourceCache(source)
    texts: dict[str, bytes] = {}  # the .py files scan reads, compiled without a second read
    manifest, skipped = sync.scan(source, config.trainer.exclude, cache, texts)
    entry = Path(config.trainer.entry).as_posix()
    if entry not in manifest:
        raise UsageError(
            f"trainer.entry {entry} is not in {source} (or trainer.exclude leaves it out)",
            hint="set trainer.entry to a .py file inside trainer.source",
        )
    checked = sync.check_syntax(source, manifest, cache, texts)
    cache.save(manifest)
    return manifest, checked, skipped


def check_source(config: Config) -> tuple[sync.Manifest, sync.Skipped]:
    """preflight as a step of a deploy: its line, and one line naming what
    trainer.exclude left out."""
    with terminal.step("checking the trainer source") as step:
        manifest, checked, skipped = preflight(config)
        step["done"] = (
            f"checked {config.trainer.source}: {len(manifest)} files, {checked} Python files compile"
        )
    left_out = skipped.describe(terminal.human_bytes)
    if left_out:
        terminal.info(f"  {left_out}")
    return manifest, skipped


def confirm_size(config: Config, plan: Plan, *, yes: bool) -> None:
    """More than trainer.confirm_above_mb to send: ask on a terminal; elsewhere
    only --yes sends it. Refusing is exit 2 with nothing sent."""
    limit = config.trainer.confirm_above_mb
    size = plan.bytes_to_send if plan.new_release else 0
    if yes or limit is None or size <= limit * 1e6:
        return
    largest = sorted(plan.diff.changed, key=lambda p: -plan.manifest[p][0])[:3]
    what = ", ".join(f"{p} ({terminal.human_bytes(plan.manifest[p][0])})" for p in largest)
    question = (
        f"this deploy sends {terminal.human_bytes(size)}, more than "
        f"trainer.confirm_above_mb ({limit:g} MB); largest: {what}"
    )
    hint = "leave big files out with trainer.exclude, or raise trainer.confirm_above_mb"
    if not (sys.stdin.isatty() and terminal.interactive()):
        raise UsageError(f"{question}; nothing was sent", hint=f"pass --yes to send it, {hint}")
    if not typer.confirm(f"{question}. Send it?", err=True):
        raise UsageError("nothing was sent", hint=hint)


# --------------------------------------------------------------------------- uploading


def upload_and_deploy(
    config: Config,
    target: Target,
    plan: Plan,
    archive: Archive,
    launch: LaunchParams,
    progress: Callable[[int], None] | None = None,
    verb: str = "deploy",
) -> LaunchAnswer:
    """Round trip 2, one command: the agent (in the container, through `pct exec`)
    reads its program and then the archive off the command's stdin, unpacking the
    archive into the new release as it arrives (read from disk here as it is sent:
    no copy of it on the host or in the container), checks every file against the
    manifest's sha256, then stops stale runs and launches (verb `build`: builds only).
    The command goes through the system's OpenSSH when it can (transport.run_bulk).
    `progress(n)` as pieces of the archive go out. Returns the agent's answer."""
    workdir, python = config.container.workdir, config.container.python
    release = plan.new_release
    assert release is not None
    params: LaunchParams = {
        **launch,
        "release": release,
        "archive": "-",
        "archive_size": archive.size,
        "manifest_sha256": hashlib.sha256(archive.metadata).hexdigest(),
        "base": plan.base_release,
        # Uploads that interrupted deploys of earlier versions left in /tmp.
        "upload_prefix": releases.upload_prefix(workdir, target.vmid),
    }
    program = agent_client.agent_input(verb, params)
    agent = agent_client.streamed_agent_argv(python, verb, len(program))
    argv = agent if target.vmid is None else pct.exec_argv(target.vmid, agent)
    stdin = itertools.chain([program], archive.chunks(progress))
    # Room for a slow link: 1 MB/s on top of the agent's own work.
    timeout = 600 + float(params["grace_s"]) + archive.size / 1e6
    if params.get("setup"):  # the deploy verb makes the venv when it is missing
        timeout += float(params["setup"]["timeout_s"])
    if params.get("wait"):
        timeout += QUEUED_WAIT_S
    try:
        result = target.transport.run_bulk(argv, stdin=stdin, timeout=timeout)
    except HostError as exc:
        from dflashctl.transport import ConnectionLost

        if isinstance(exc, ConnectionLost):
            # Once the archive is there, the host finishes the deploy without us.
            exc.hint = (
                "if the upload had finished, the deploy may have completed on the host: "
                f"{hints.command('runs')} shows whether a new run started; otherwise deploy again"
            )
        raise
    if target.vmid is not None and pct.pct_missing(result):
        raise pct.not_a_proxmox_node("pct", target.transport.description)
    if target.vmid is not None:
        pct.raise_for_pct(result, target.vmid, "exec")
    answer = agent_client.parse_agent_answer(result, python, verb, target.describe())
    return cast(LaunchAnswer, answer)


def setup_then_launch(
    config: Config, target: Target, params: LaunchParams, built: LaunchAnswer
) -> LaunchAnswer:
    """The release is built (nothing stopped yet): stream its setup, then launch it.
    A failed setup removes the unused release and stops nothing."""
    release = built["release"]
    try:
        setup_env.run_setup(config, target, release)
    except BaseException:
        try:
            agent_client.call_agent(
                target,
                config.container.python,
                "discard",
                {"workdir": config.container.workdir, "release": release},
            )
        except HostError:
            pass  # an unused release is only space; the next deploy's gc removes it
        raise
    # `expect` was checked by the build; the launch's own check would compare the
    # new release with the old manifest.
    launch = cast(LaunchParams, {k: v for k, v in params.items() if k != "expect"})
    launched = stop_and_launch(config, target, dict(launch, release=release))  # type: ignore[arg-type]
    launched["build"] = built["build"]
    return launched


# --------------------------------------------------------------------------- deploy


@dataclass
class DeployOptions:
    detach: bool = False
    dry_run: bool = False
    start_container: bool = False
    fresh: bool = False  # start at step 0, not from the replaced run's checkpoint
    wait: bool = False  # queue behind a deploy in flight instead of being refused
    extra_args: list[str] = field(default_factory=list)
    yes: bool = False  # send more than trainer.confirm_above_mb without asking


def deploy(
    config: Config,
    options: DeployOptions,
) -> tuple[int, dict[str, Any]]:
    """Run a deploy on the config's one node; returns (exit code, the JSON summary).
    Several nodes go through deploy_nodes.deploy_nodes, which is built from the steps
    here (so this module never imports it)."""
    started = time.monotonic()
    # A mistake in crash_patterns is a config error: said before anything is contacted.
    rules = rules_for(config)
    manifest, skipped = check_source(config)
    meta = config_meta(config)
    # Asking git takes a few subprocesses: done while the host answers.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="git-state") as pool:
        git = pool.submit(git_state, Path(config.trainer.source))
        with session(config) as target:
            summary = None
            last = None if options.dry_run else releases.load_last_deploy(config)
            if last is None and not options.dry_run:
                target.transport.prepare_bulk()  # while the container is inspected
            if last is not None:
                try:
                    plan = plan_from(config, options, manifest, last.release, last.manifest)
                    confirm_size(config, plan, yes=options.yes)
                    summary = _execute(config, target, plan, meta, git, started, last)
                except (agent_client.AgentFailed, pct.ContainerNotRunning) as exc:
                    if isinstance(exc, agent_client.AgentFailed) and not exc.stale:
                        raise
                    # The container changed since our last deploy (or is stopped): ask it.
            if summary is None:
                plan = inspected_plan(config, target, options, manifest)
                if options.dry_run:
                    return 0, print_plan(config, plan)
                confirm_size(config, plan, yes=options.yes)
                summary = _execute(config, target, plan, meta, git, started, None)
            summary["left_out"] = skipped.names()
            return follow_unless_detached(
                lone_node(config, target), rules, summary, detach=options.detach
            )


def plan_from(
    config: Config,
    options: DeployOptions,
    manifest: sync.Manifest,
    base: str | None,
    remote: sync.Manifest | None,
    to_stop: list[ProcessToStop] | None = None,
) -> Plan:
    diff = sync.diff_manifests(manifest, remote)
    return Plan(
        manifest=manifest,
        diff=diff,
        base_release=base,
        new_release=None if (base and diff.empty) else runs.new_id(),
        to_stop=to_stop or [],
        command=trainer_command(config, options.extra_args),
        fresh=options.fresh,
        wait=options.wait,
    )


def inspected_plan(
    config: Config, target: Target, options: DeployOptions, manifest: sync.Manifest
) -> Plan:
    """Round trip 1 when the last deploy's plan is unknown or out of date."""
    with terminal.step(f"inspecting {target.describe()}") as step:
        state = inspect(
            config,
            target,
            # A dry run changes nothing, a stopped container included.
            may_start=(options.start_container or config.container.start_if_stopped)
            and not options.dry_run,
        )
        base = state.get("release")
        plan = plan_from(
            config, options, manifest, base, state.get("manifest"), state.get("to_stop")
        )
        plan.active_run = state.get("active_run")
        plan.continues = state.get("continues")
        running = [t for t in plan.to_stop if t.get("kind") == "active"]
        step["done"] = (
            f"inspected {target.describe()}: "
            + (f"release {base}" if base else "nothing deployed yet")
            + (f", run {running[0]['run_id']} running" if running else "")
            + f", python {state.get('python')}"
        )
    return plan


def _execute(config, target, plan, meta, git, started, last):
    """Send what changed, stop stale runs, launch: one round trip. With `last` (the
    release this machine deployed there last time), the agent first checks that it
    is still current and intact, else answers `stale` having changed nothing.
    Returns the deploy's JSON summary."""
    run_id = runs.new_id()
    meta.update(git.result())
    params = launch_params(
        config, run_id, plan.release, plan.command, meta, fresh=plan.fresh, wait=plan.wait
    )
    if last is not None:
        params["expect"] = {"release": last.release, "manifest": last.manifest}
    try:
        return _send_and_launch(config, target, plan, params, run_id, started)
    except KeyboardInterrupt:
        report_interrupted(config, run_id, float(params["grace_s"]))
        raise


def _send_and_launch(config, target, plan, params, run_id, started):
    diff, manifest, command = plan.diff, plan.manifest, plan.command
    stopping = f", stopping {len(plan.to_stop)} run(s)" if plan.to_stop else ""
    archive_bytes = 0
    built: dict[str, Any] = {}
    streamed_setup = setup_env.needs_streaming(config)
    t0 = time.monotonic()
    if plan.new_release:
        source = Path(config.trainer.source)
        archive = Archive.of_release(source, manifest, diff.changed, SourceCache(source))
        archive_bytes = archive.size
        size = terminal.human_bytes(plan.bytes_to_send)
        with terminal.transfer(
            archive.size,
            f"sending {len(diff.changed)} files",
            f"unpacking{stopping}, launching",
        ) as progress:
            if streamed_setup:  # build only: the setup streams before the launch
                built_only = upload_and_deploy(
                    config, target, plan, archive, params, progress, verb="build"
                )
            else:
                launched = upload_and_deploy(config, target, plan, archive, params, progress)
        if streamed_setup:
            launched = setup_then_launch(config, target, params, built_only)
        built = launched["build"]
        # One call did it all: what the agent did not spend stopping and launching
        # went into sending and unpacking.
        synced_s = max(
            time.monotonic()
            - t0
            - float(launched.get("stop_seconds") or 0.0)
            - float(launched.get("launch_seconds") or 0.0),
            0.0,
        )
        terminal.step_done(
            f"synced {len(diff.changed)} of {len(manifest)} files "
            f"({size}, {built.get('linked', 0)} reused"
            + (f", {len(diff.removed)} removed" if diff.removed else "")
            + f") into release {plan.new_release}",
            synced_s,
        )
    else:
        synced_s = 0.0
        if streamed_setup:
            setup_env.run_setup(config, target, plan.base_release)
        with terminal.spinner(f"launching{stopping}"):
            launched = stop_and_launch(config, target, params)
        terminal.step_done(f"no changes: release {plan.base_release} stays (nothing sent)", 0.0)
    releases.save_last_deploy(config, launched["release"], manifest)
    print_launched(launched, run_id, command, time.monotonic() - t0 - synced_s)
    summary = {
        "release": launched["release"],
        "previous_release": plan.base_release,
        "run_id": run_id,
        "pid": launched["run"]["pid"],
        "files_sent": len(diff.changed) if plan.new_release else 0,
        "bytes_sent": plan.bytes_to_send if plan.new_release else 0,
        "archive_bytes": archive_bytes,
        # The agent's unpacking and checking of the release, and its CPU time by then.
        "build_seconds": built.get("seconds"),
        "build_cpu_seconds": built.get("cpu_seconds"),
        "files_total": len(manifest),
        "files_removed": len(diff.removed) if plan.new_release else 0,
        "runs_stopped": launched["stopped"],
        "releases_removed": launched.get("releases_removed", []),
        "command": command,
        **lineage_summary(launched["run"]),
        "target": target.describe(),
        "seconds": round(time.monotonic() - started, 3),
        "dry_run": False,
    }
    return summary


def print_plan(config: Config, plan: Plan) -> dict[str, Any]:
    """The dry run's answer: what would travel, stop and start. Nothing was changed."""
    out = terminal.out
    diff = plan.diff
    out.print(f"[bold]plan[/bold] (dry run, nothing changed) for {config.container.workdir}")
    if plan.new_release:
        out.print(
            f"  new release {plan.new_release}: send {len(diff.changed)} of "
            f"{len(plan.manifest)} files ({terminal.human_bytes(plan.bytes_to_send)})"
            + (f", drop {len(diff.removed)}" if diff.removed else "")
        )
        for rel in diff.changed:
            out.print(f"    + {rel}  ({terminal.human_bytes(plan.manifest[rel][0])})")
        for rel in diff.removed:
            out.print(f"    - {rel}")
    else:
        out.print(f"  no changes: release {plan.base_release} stays (nothing sent)")
    if plan.to_stop:
        out.print(f"  stop (SIGTERM, {config.run.stop_grace_s:g} s grace, then SIGKILL):")
        for item in plan.to_stop:
            out.print(f"    {describe_target_to_stop(item)}")
    else:
        out.print("  nothing to stop")
    setup = setup_env.setup_params(config)
    if setup:
        what = [f"pip install -r {setup['requirements']}"] if setup["requirements"] else []
        what += setup["commands"]
        out.print(f"  setup (in a venv, once per content): {'; '.join(what)}")
    out.print(f"  launch in {config.container.workdir}/current: {shlex.join(plan.command)}")
    out.print(f"  the new run {describe_start(plan.continues, plan.active_run, fresh=plan.fresh)}")
    return {
        "dry_run": True,
        "release": plan.new_release,
        "previous_release": plan.base_release,
        "files_to_send": [{"path": p, "size": plan.manifest[p][0]} for p in diff.changed]
        if plan.new_release
        else [],
        "files_removed": diff.removed if plan.new_release else [],
        "bytes_to_send": plan.bytes_to_send if plan.new_release else 0,
        "runs_to_stop": plan.to_stop,
        "command": plan.command,
        "fresh": plan.fresh,
        "continues": None if plan.fresh else plan.continues,
    }
