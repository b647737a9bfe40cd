"""deploy, restart and stop: the orchestration, in as few round trips as possible.

A deploy is at most two commands over one SSH connection, each answered by the agent
(dflashctl/agent.py) where the trainer runs:

  1. inspect   the current release's real manifest, the runs to stop   (read only)
  2. deploy    one `sh -c` on the host: the archive of changed files arrives on its
               stdin, is `pct push`ed into the container as one file, and the agent
               unpacks it into releases/<id>.partial (unchanged files hard-linked from
               the current release), validates it, renames it to releases/<id>, stops
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
import shlex
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashctl import hints, pct, releases, runs, sync, terminal
from dflashctl.config import Config
from dflashctl.connect import open_proxmox, open_target, session
from dflashctl.crash import Rule, rules_for
from dflashctl.errors import HostError, UsageError
from dflashctl.follow import follow_run, report_result
from dflashctl.resources import template_path

# An upload nobody has written to for this long was abandoned by an interrupted deploy.
ABANDONED_UPLOAD_MIN = 1

# --------------------------------------------------------------------------- the target


def process_scope(config: Config) -> str:
    """Where a hand-started trainer may be: anywhere in a container of its own; on a
    machine without one, only under the workdir (other projects share the machine)."""
    return "container" if config.container.vmid is not None else "workdir"


def start_container(config: Config, target: Any) -> Any:
    """Start the container through the Proxmox API (pvesh over this connection, or
    HTTPS with a token) and wait until it runs; returns its state."""
    from dflashctl import proxmox

    api = open_proxmox(config, target.transport)
    return proxmox.start_container(
        api, config.proxmox.node, target.vmid, timeout=config.proxmox.start_timeout_s
    )


def inspect(config: Config, target: Any, *, may_start: bool) -> dict[str, Any]:
    """Round trip 1; starts a stopped container first when allowed (else exit 3)."""
    params = {
        "workdir": config.container.workdir,
        "entry": config.trainer.entry,
        "scope": process_scope(config),
    }
    try:
        return runs.call_agent(target, config.container.python, "inspect", params)
    except pct.ContainerNotRunning as exc:
        if not may_start:
            exc.hint = (
                f"start it with `pct start {target.vmid}` on the host, pass --start-container, "
                "or set container.start_if_stopped: true"
            )
            raise
    with terminal.step(f"starting container {target.vmid}") as step:
        status = start_container(config, target)
        step["done"] = f"started container {target.vmid}"
    if status.warnings:
        terminal.warning(f"container {target.vmid} started with warnings: {status.warnings}")
    return runs.call_agent(target, config.container.python, "inspect", params)


# --------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    manifest: sync.Manifest
    diff: sync.Diff
    base_release: str | None  # the release now current, if any
    new_release: str | None  # None: nothing changed, the current release is reused
    to_stop: list[dict[str, Any]]
    command: list[str]

    @property
    def bytes_to_send(self) -> int:
        return sum(self.manifest[p][0] for p in self.diff.changed)

    @property
    def release(self) -> str | None:
        return self.new_release or self.base_release


def trainer_command(config: Config, extra_args: list[str]) -> list[str]:
    return [config.container.python, config.trainer.entry, *config.trainer.args, *extra_args]


def preflight(config: Config) -> tuple[sync.Manifest, int]:
    """The local checks that need no host: the tree, the entry script, every .py compiles."""
    source = Path(config.trainer.source)
    manifest = sync.build_manifest(source, config.trainer.exclude)
    entry = Path(config.trainer.entry).as_posix()
    if entry not in manifest:
        raise UsageError(
            f"trainer.entry {entry} is not in {source} (or trainer.exclude leaves it out)",
            hint="set trainer.entry to a .py file inside trainer.source",
        )
    checked = sync.check_syntax(source, manifest)
    return manifest, checked


def git_state(source: Path) -> dict[str, Any]:
    """The source's git commit and whether it has uncommitted changes (if in git)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return {}
        status = subprocess.run(
            ["git", "-C", str(source), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {"git_commit": head.stdout.strip(), "git_dirty": bool(status.stdout.strip())}


# --------------------------------------------------------------------------- uploading


def upload_and_deploy(
    config: Config, target: Any, plan: Plan, archive: bytes, launch: dict[str, Any]
) -> dict[str, Any]:
    """Round trip 2, one command on the host: the archive arrives on its stdin (no
    extra round trips for a file transfer), is `pct push`ed into the container as one
    file, and the agent, reading the rest of stdin, builds the release, stops stale
    runs and launches. Returns the agent's answer."""
    workdir, python = config.container.workdir, config.container.python
    release = plan.new_release
    assert release is not None
    prefix = releases.upload_prefix(workdir, target.vmid)
    dest = releases.upload_path(prefix, release)
    staged = dest if target.vmid is None else releases.upload_path(prefix, release, "/tmp")
    params = dict(
        launch, release=release, archive=dest, base=plan.base_release, upload_prefix=prefix
    )
    agent = runs.agent_argv(python, "deploy")
    if target.vmid is None:
        run_agent = shlex.join(agent)
        push = ""
    else:
        # pct push exits 0 when its copy fails: the agent starts only once the archive
        # in the container has its size and sha256 (checked in the same pct exec).
        digest = hashlib.sha256(archive).hexdigest()
        checked = pct.checked_argv(dest, len(archive), digest, agent)
        run_agent = shlex.join(pct.exec_argv(target.vmid, checked))
        push = pct.push_script(target.vmid, shlex.quote(staged), dest, 0o600)
    script = (
        # Leftovers of interrupted uploads to this target, once nobody writes to them.
        f"find /tmp -maxdepth 1 -type f -name '{prefix}*' -mmin +{ABANDONED_UPLOAD_MIN} "
        "-delete 2>/dev/null\n"
        # GNU head reads no more than it is asked for: the rest of stdin is the agent's.
        # (umask in a subshell: the agent's files keep the usual modes.)
        f"(umask 077; head -c {len(archive)} > {shlex.quote(staged)})\n"
        f'if [ "$(wc -c < {shlex.quote(staged)})" -ne {len(archive)} ]; then\n'
        f"  rm -f -- {shlex.quote(staged)}; echo '{_UPLOAD_CUT}' >&2; exit 198\n"
        "fi\n"
        f"{push}"
        f"exec {run_agent}\n"
    )
    stdin = archive + runs.agent_input("deploy", params)
    timeout = 600 + float(params["grace_s"])
    try:
        result = target.transport.run(
            ["sh", "-c", script], stdin=stdin, timeout=timeout, check=False
        )
    except HostError as exc:
        from dflashctl.transport import ConnectionLost

        if isinstance(exc, ConnectionLost):
            # Once the archive is there, the host finishes the deploy without us.
            exc.hint = (
                "if the upload had finished, the deploy may have completed on the host: "
                f"{hints.command('runs')} shows whether a new run started; otherwise deploy again"
            )
        raise
    if result.exit_status == 198 and _UPLOAD_CUT in result.stderr_text:
        raise HostError(
            f"the upload to {target.describe()} arrived incomplete",
            hint="check the connection and the host's free space in /tmp, then deploy again",
        )
    if target.vmid is not None and pct.push_went_wrong(result):
        pct.raise_for_push(result, target.vmid, dest, len(archive), 0o600)
    if target.vmid is not None:
        pct.raise_for_pct(result, target.vmid, "exec")
    return runs.parse_agent_answer(result, python, "deploy", runs.describe_target(target))


_UPLOAD_CUT = "dflashctl: upload cut short"


# --------------------------------------------------------------------------- launching


def launch_params(
    config: Config,
    run_id: str,
    release: str | None,
    command: list[str],
    meta: dict[str, Any],
    grace_s: float | None = None,
) -> dict[str, Any]:
    return {
        "workdir": config.container.workdir,
        "release": release,
        "run_id": run_id,
        "entry": config.trainer.entry,
        "scope": process_scope(config),
        "command": command,
        "env": {
            **config.trainer.env,
            **({"DFLASH_ON_EXIT": config.run.on_exit} if config.run.on_exit else {}),
        },
        "grace_s": config.run.stop_grace_s if grace_s is None else grace_s,
        "keep_releases": config.run.keep_releases,
        "meta": meta,
        "launch_script": template_path("launch.sh").read_text(encoding="utf-8"),
    }


def stop_and_launch(config: Config, target: Any, params: dict[str, Any]) -> dict[str, Any]:
    """Stop stale runs and launch `params["release"]` (None: the current one) in one
    round trip: a deploy with nothing to send, and restart."""
    grace = float(params["grace_s"])
    timeout = grace + 120
    try:
        return runs.call_agent(target, config.container.python, "launch", params, timeout=timeout)
    except HostError as exc:
        if params.get("release"):
            exc.hint = exc.hint or (
                f"release {params['release']} is unpacked in {config.container.workdir}/releases; "
                f"{hints.command('restart')} launches the current release again"
            )
        raise


def describe_stopped(stopped: dict[str, Any]) -> str:
    who = f"run {stopped['run_id']}" if stopped.get("run_id") else "hand-started process"
    what = f"{who} (pid {stopped['pid']})"
    if stopped["ended"] == "terminated":
        how = f"exited after SIGTERM in {stopped.get('seconds', 0):.1f} s"
    elif stopped["ended"] == "killed":
        how = f"killed with SIGKILL after the {stopped.get('seconds', 0):.0f} s grace period"
    else:
        how = stopped["ended"]
    code = stopped.get("exit_code")
    if code is not None:
        how += f", exit code {code}"
    return f"stopped {what}: {how}"


def print_stopped(stopped: list[dict[str, Any]], seconds: float) -> None:
    if not stopped:
        return
    for index, item in enumerate(stopped):
        terminal.step_done(describe_stopped(item), seconds if index == 0 else 0.0)


def describe_target_to_stop(item: dict[str, Any]) -> str:
    who = f"run {item['run_id']}" if item.get("run_id") else "hand-started"
    scope = "its process group" if item.get("group") else "the process and its children"
    return f"pid {item['pid']} ({who}, {scope}): {item.get('cmdline', '')}"


def print_launched(
    launched: dict[str, Any], run_id: str, command: list[str], seconds: float
) -> None:
    """The runs the agent stopped, then the one it launched; `seconds` is the time the
    stop and launch took together."""
    stop_s = float(launched.get("stop_seconds") or 0.0) if launched["stopped"] else 0.0
    print_stopped(launched["stopped"], stop_s)
    terminal.step_done(
        f"launched run {run_id} (pid {launched['run']['pid']}) from release "
        f"{launched['release']}: {shlex.join(command)}",
        max(seconds - stop_s, 0.0),
    )


# --------------------------------------------------------------------------- following


def follow_unless_detached(
    config: Config, target: Any, rules: list[Rule], summary: dict[str, Any], *, detach: bool
) -> tuple[int, dict[str, Any]]:
    """Follow the new run's log as `logs --follow` does; (exit code, summary with the
    run's result)."""
    run_id = summary["run_id"]
    if detach:
        terminal.info(f"follow it with {hints.command(f'logs -f {run_id}')}")
        return 0, summary
    result = follow_run(
        lambda: open_target(config),
        config.container.workdir,
        run_id,
        rules=rules,
        target=target,
        python=config.container.python,
        from_offset=0,
    )
    summary["result"] = result.to_json()
    return report_result(result), summary


# --------------------------------------------------------------------------- deploy


@dataclass
class DeployOptions:
    detach: bool = False
    dry_run: bool = False
    start_container: bool = False
    extra_args: list[str] = field(default_factory=list)


def deploy(
    config: Config,
    options: DeployOptions,
    *,
    open_with: Callable[[Config], Any] | None = None,
) -> tuple[int, dict[str, Any]]:
    """Run a deploy; returns (exit code, the JSON summary)."""
    started = time.monotonic()
    # A mistake in crash_patterns is a config error: said before anything is contacted.
    rules = rules_for(config)
    with terminal.step("checking the trainer source") as step:
        manifest, checked = preflight(config)
        step["done"] = (
            f"checked {config.trainer.source}: {len(manifest)} files, {checked} Python files compile"
        )
    meta = {"config_digest": config.digest, "config_path": str(config.path)}
    # Asking git takes a few subprocesses: done while the host answers.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="git-state") as pool:
        git = pool.submit(git_state, Path(config.trainer.source))
        with session(config, open_with) as target:
            summary = None
            last = None if options.dry_run else releases.load_last_deploy(config)
            if last is not None:
                try:
                    plan = plan_from(config, options, manifest, last.release, last.manifest)
                    summary = _execute(config, target, plan, meta, git, started, last)
                except (runs.AgentFailed, pct.ContainerNotRunning) as exc:
                    if isinstance(exc, runs.AgentFailed) and not exc.stale:
                        raise
                    # The container changed since our last deploy (or is stopped): ask it.
            if summary is None:
                plan = inspected_plan(config, target, options, manifest)
                if options.dry_run:
                    return 0, print_plan(config, plan)
                summary = _execute(config, target, plan, meta, git, started, None)
            return follow_unless_detached(config, target, rules, summary, detach=options.detach)


def plan_from(
    config: Config,
    options: DeployOptions,
    manifest: sync.Manifest,
    base: str | None,
    remote: sync.Manifest | None,
    to_stop: list[dict[str, Any]] | None = None,
) -> Plan:
    diff = sync.diff_manifests(manifest, remote)
    return Plan(
        manifest=manifest,
        diff=diff,
        base_release=base,
        new_release=None if (base and diff.empty) else runs.new_id(),
        to_stop=to_stop or [],
        command=trainer_command(config, options.extra_args),
    )


def inspected_plan(
    config: Config, target: Any, options: DeployOptions, manifest: sync.Manifest
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
    diff, manifest = plan.diff, plan.manifest
    run_id = runs.new_id()
    command = plan.command
    meta.update(git.result())
    params = launch_params(config, run_id, plan.release, command, meta)
    if last is not None:
        params["expect"] = {"release": last.release, "manifest": last.manifest}
    stopping = f", stopping {len(plan.to_stop)} run(s)" if plan.to_stop else ""
    archive_bytes = 0
    t0 = time.monotonic()
    if plan.new_release:
        archive = sync.make_archive(Path(config.trainer.source), manifest, diff.changed)
        archive_bytes = len(archive)
        size = terminal.human_bytes(plan.bytes_to_send)
        with terminal.spinner(f"sending {len(diff.changed)} files ({size}){stopping}, launching"):
            launched = upload_and_deploy(config, target, plan, archive, params)
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
        "files_total": len(manifest),
        "files_removed": len(diff.removed) if plan.new_release else 0,
        "runs_stopped": launched["stopped"],
        "releases_removed": launched.get("releases_removed", []),
        "command": command,
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
    out.print(f"  launch in {config.container.workdir}/current: {shlex.join(plan.command)}")
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
    }


# --------------------------------------------------------------------------- restart, stop


def restart(
    config: Config,
    *,
    detach: bool,
    extra_args: list[str] | None = None,
    open_with: Callable[[Config], Any] | None = None,
) -> tuple[int, dict[str, Any]]:
    """Stop stale runs and launch the current release again: one round trip, no sync."""
    rules = rules_for(config)  # config mistakes first, before anything is contacted
    with session(config, open_with) as target:
        run_id = runs.new_id()
        command = trainer_command(config, extra_args or [])
        meta = {"config_digest": config.digest, "config_path": str(config.path), "restart": True}
        params = launch_params(config, run_id, None, command, meta)
        t0 = time.monotonic()
        with terminal.spinner("stopping stale runs and launching"):
            launched = stop_and_launch(config, target, params)
        print_launched(launched, run_id, command, time.monotonic() - t0)
        summary = {
            "release": launched["release"],
            "run_id": run_id,
            "pid": launched["run"]["pid"],
            "runs_stopped": launched["stopped"],
            "command": command,
            "target": target.describe(),
        }
        return follow_unless_detached(config, target, rules, summary, detach=detach)


def stop(
    config: Config,
    *,
    grace_s: float | None = None,
    open_with: Callable[[Config], Any] | None = None,
) -> dict[str, Any]:
    """Stop the active run and hand-started ones (SIGTERM, grace, SIGKILL)."""
    grace = config.run.stop_grace_s if grace_s is None else grace_s
    with session(config, open_with) as target:
        params = {
            "workdir": config.container.workdir,
            "entry": config.trainer.entry,
            "scope": process_scope(config),
            "grace_s": grace,
        }
        with terminal.step("stopping runs") as step:
            answer = runs.call_agent(
                target, config.container.python, "stop", params, timeout=grace + 60
            )
            stopped = answer["stopped"]
            step["done"] = (
                f"stopped {len(stopped)} run(s)"
                if stopped
                else f"nothing to stop on {target.describe()}"
            )
        for item in stopped:
            terminal.info(f"  {describe_stopped(item)}")
        if not answer.get("all_stopped", True):
            raise HostError(
                "a run did not exit even after SIGKILL",
                hint="check the container with `ps -ef`; the process may be stuck in I/O",
            )
        return {"stopped": stopped, "target": target.describe()}
