"""deploy: the orchestration, in as few round trips as possible, the same on one node
and on N (restart and stop are in ops/restart.py, what they share in ops/launching.py).

A deploy is at most two commands per node over one SSH connection per host, each
answered by the agent (the package dflashctl/agent/, see remote/agent_client.py) where the
trainer runs, on every node at once:

  1. inspect   the current release's real manifest, the runs to stop   (read only)
  2. deploy    one `pct exec` of the agent: the archive of changed files follows the
               agent's program on its stdin and is unpacked as it arrives into
               releases/<id>.partial (unchanged files hard-linked from the current
               release), validated, renamed to releases/<id>; then the agent stops
               stale runs, swaps `current`, launches the run detached and records it
               (`launch` instead when nothing changed there)

Step 1 is skipped on each node this machine remembers what it deployed to last (see
releases.LastDeploy): the agent then checks that release is still current and intact
before relying on it, and answers `stale` (changing nothing) when it is not.

Before anything is stopped the new release is complete and validated; `current`
moves only after the old run is gone. On several nodes every node's agent then waits
at the commit barrier (ops/launch_command.py, ops/committing.py): either every node launches
or none does. An interruption before the agent's stop step leaves the old release
current and the old run running; the next deploy removes partial releases and
abandoned uploads.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from dflashctl import hints
from dflashctl.config.schema import Config
from dflashctl.errors import DflashError, HostError
from dflashctl.humanize import human_bytes
from dflashctl.ops import early_upload, releases, setup_env
from dflashctl.ops.archive import Archive
from dflashctl.ops.committing import launch_everywhere
from dflashctl.ops.deploy_plan import (  # noqa: F401 - DeployOptions, inspect, preflight: the API
    DeployOptions,
    Plan,
    check_source,
    confirm_size,
    dry_run_summary,
    inspect,
    make_plans,
    preflight,
)
from dflashctl.ops.launch_command import every_launch_params
from dflashctl.ops.launching import (
    config_meta,
    follow_unless_detached,
    git_state,
    import_follower,
    interrupt_said,
    launch_timeout,
    say_every_launch,
    start_line,
    stop_and_launch,
)
from dflashctl.ops.source_cache import SourceCache
from dflashctl.remote import agent_client, pct
from dflashctl.remote.agent_messages import LaunchAnswer, LaunchParams
from dflashctl.remote.deploy_target import Target
from dflashctl.remote.nodes import (
    Node,
    NodesFailed,
    names_each_node,
    node_sessions,
    on_every_node,
    values_or_raise,
)
from dflashctl.reporting import SILENT, Reporter
from dflashctl.runs import records as runs

# --------------------------------------------------------------------------- uploading


def upload_argv(config: Config, target: Target, verb: str) -> list[str]:
    """The command of upload_and_deploy's one call: the agent, which reads its program
    and then the archive off stdin (the same command every time, so that it can be
    started before either is ready: transport.prepare_bulk)."""
    # The deploy verb checks the trainer's config before its stop: its interpreter starts
    # with the agent (the build verb's launch is another call).
    check_in = config.container.workdir if verb == "deploy" else None
    agent = agent_client.agent_argv(config.container.python, verb, preload=True, check_in=check_in)
    return agent if target.vmid is None else pct.exec_argv(target.vmid, agent)


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
    stdin = itertools.chain([program], archive.chunks(progress))
    argv = upload_argv(config, target, verb)
    # Room for a slow link: 1 MB/s on top of the agent's own work.
    timeout = launch_timeout(params, 600 + archive.size / 1e6)
    try:
        result = target.transport.run_bulk(argv, stdin=stdin, timeout=timeout)
    except HostError as exc:
        from dflashctl.remote.transport import ConnectionLost

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
        pct.raise_for_pct(result, target.vmid)
    answer = agent_client.parse_agent_answer(result, python, verb, target.describe())
    return cast(LaunchAnswer, answer)


# --------------------------------------------------------------------------- deploy


def deploy(
    config: Config, options: DeployOptions, report: Reporter = SILENT
) -> tuple[int, dict[str, Any]]:
    """Run a deploy on every node of the config (one, or several as one torchrun job);
    returns (exit code, the JSON summary: with --dry-run, the plan). What it does as it
    goes is told to `report`."""
    started = time.monotonic()
    # The crash rules are for following the run: a detached deploy of a config with no
    # crash_patterns of its own neither loads nor compiles them (a tenth of a one-file
    # redeploy's CPU). A mistake in crash_patterns is a config error: said before
    # anything is contacted.
    # A detached deploy that waits for the run's start line (launching.start_line)
    # follows its start, and weighs a crash before it, as following does.
    follows = not options.detach or start_line(config) is not None
    rules = []
    if config.crash_patterns or follows:
        from dflashctl.crash import rules_for

        rules = rules_for(config)
    if follows:
        import_follower()
    manifest, skipped = check_source(config, report)
    meta = config_meta(config)
    # Asking git takes a few subprocesses: done while the hosts answer.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="git-state") as pool:
        git = pool.submit(git_state, Path(config.trainer.source))
        with node_sessions(config) as nodes:
            lasts = [
                None if options.dry_run else releases.load_last_deploy(n.config) for n in nodes
            ]
            # The upload's connection, `pct exec` and the agent's interpreter start
            # while the container is inspected and the archive planned.
            verb = "build" if setup_env.needs_streaming(config) else "deploy"
            # (Not where the deploy may start the container: it is not running yet.)
            early = not (options.dry_run or options.start_container)
            for node in nodes if early else []:
                node.target.transport.prepare_bulk(upload_argv(node.config, node.target, verb))
            plans = make_plans(config, nodes, options, manifest, lasts, report)
            if options.dry_run:
                return 0, dry_run_summary(nodes, plans)
            if config.run.gpus is not None:  # shared box: other runs' GPUs are theirs
                refuse_held_gpus(nodes)
            biggest = max(plans, key=lambda p: p.bytes_to_send)
            confirm_size(config, biggest, yes=options.yes, report=report)
            run = Execution(config, options, meta, git, started, report)
            try:
                summary = run.execute(nodes, plans, lasts)
            except DflashError as exc:
                stale = stale_nodes(exc, nodes, lasts)
                if not stale:
                    raise
                # The container changed since our last deploy (or is stopped): ask it.
                for node in stale:
                    lasts[node.index] = None
                plans = make_plans(config, nodes, options, manifest, lasts, report)
                biggest = max(plans, key=lambda p: p.bytes_to_send)
                confirm_size(config, biggest, yes=options.yes, report=report)
                summary = run.execute(nodes, plans, lasts)
            for entry in summary["nodes"]:
                entry["left_out"] = skipped.names()
            remember_uploads(config, nodes, verb)
            return follow_unless_detached(
                nodes, rules, summary, detach=options.detach, report=report
            )


def refuse_held_gpus(nodes: list[Node]) -> None:
    from dflashctl.container.holders import refuse_if_held
    from dflashctl.remote.connect import as_host_error

    for node in nodes:
        with as_host_error(node.target):
            refuse_if_held(node.target, node.config.container.workdir, node.config.run.gpus)


def remember_uploads(config: Config, nodes: list[Node], verb: str) -> None:
    """The upload commands of this config's nodes, for the next deploy of the same
    config to start as it starts (dflashctl/ops/early_upload.py)."""
    lines = [
        n.target.transport.bulk_command_line(upload_argv(n.config, n.target, verb)) for n in nodes
    ]
    early_upload.remember(config.path, None if None in lines else cast(list, lines))


def stale_nodes(exc: DflashError, nodes: list[Node], lasts: list[Any]) -> list[Node]:
    """The nodes planned from the last deploy that answered `stale` (or whose container
    is stopped), when that is all that failed: inspected, they deploy again."""
    if not isinstance(exc, NodesFailed):
        return []
    errors = exc.errors()
    stale = [
        n
        for n in nodes
        if lasts[n.index] is not None
        and (
            (isinstance(errors.get(n.name), agent_client.AgentFailed) and errors[n.name].stale)
            or isinstance(errors.get(n.name), pct.ContainerNotRunning)
        )
    ]
    others_clean = all(
        err is None or getattr(err, "aborted", False)
        for name, err in errors.items()
        if name not in {n.name for n in stale}
    )
    return stale if stale and others_clean else []


@dataclass
class Execution:
    """Round trip 2 of one deploy, on every node at once: what it needs besides each
    node's plan, and where it says what it does."""

    config: Config
    options: DeployOptions
    meta: dict[str, Any]
    git: Future  # git_state's answer, asked while the hosts were inspected
    started: float
    report: Reporter

    def execute(self, nodes: list[Node], plans: list[Plan], lasts: list[Any]) -> dict[str, Any]:
        """Send what changed, build, (on several nodes) agree, stop stale runs, launch.
        With a node's `lasts` entry (the release this machine deployed there last time)
        its agent first checks that it is still current and intact, else answers
        `stale` having changed nothing. Returns the JSON summary."""
        config, options, report = self.config, self.options, self.report
        run_id = runs.new_id()
        meta = dict(self.meta, **self.git.result())
        rendezvous, params = every_launch_params(
            config, nodes, run_id, [p.release for p in plans], meta,
            extra_args=options.extra_args, fresh=options.fresh, by="deploy", wait=options.wait,
            upload_bytes=max(p.bytes_to_send if p.new_release else 0 for p in plans),
        )  # fmt: skip
        for node in nodes:
            last = lasts[node.index]
            if last is not None:
                params[node.index]["expect"] = {"release": last.release, "manifest": last.manifest}
        with interrupt_said(report, nodes, run_id, params):
            answers, synced_s, t0 = self.send_and_launch(nodes, plans, params)
        for node, answer, plan in zip(nodes, answers, plans, strict=True):
            releases.save_last_deploy(node.config, answer["release"], plan.manifest)
        top, commands = say_every_launch(
            report, nodes, answers, params, t0 + synced_s, deployed=True
        )
        entries = [
            node_entry(node, plan, answer, command, self.started)
            for node, answer, plan, command in zip(nodes, answers, plans, commands, strict=True)
        ]
        rendezvous_at = rendezvous.endpoint if rendezvous is not None else None
        return {**top, "rendezvous": rendezvous_at, "dry_run": False, "nodes": entries}

    def send_and_launch(
        self, nodes: list[Node], plans: list[Plan], params: dict[int, LaunchParams]
    ) -> tuple[list[LaunchAnswer], float, float]:
        """Each node's one call: `deploy` (the archive of what changed, then build,
        agree, stop, launch) where something changed, `launch` where nothing did. With a
        setup to stream, the releases are built first (`build`), the setup streamed,
        then launched. Returns the answers, the seconds spent sending and building, and
        when it began."""
        config, report = self.config, self.report
        t0 = time.monotonic()
        todo = [n for n in nodes if plans[n.index].new_release]
        run_id = params[nodes[0].index]["run_id"]
        streamed = setup_env.needs_streaming(config)
        archives = {}
        source = Path(config.trainer.source)
        for node in todo:
            plan = plans[node.index]
            archives[node.index] = Archive.of_release(
                source, plan.manifest, plan.diff.changed, SourceCache(source)
            )
        stopping = sum(len(p.to_stop) for p in plans)

        def one(node: Node, progress) -> LaunchAnswer:
            """The node's one call: `launch` where nothing changed, else the upload."""
            p, plan = params[node.index], plans[node.index]
            if node not in todo:
                return stop_and_launch(node.config, node.target, p)
            archive = archives[node.index]
            if streamed:
                return upload_and_deploy(
                    node.config, node.target, plan, archive, p, progress, verb="build"
                )
            return upload_and_deploy(node.config, node.target, plan, archive, p, progress)

        if not todo:
            if streamed:
                setup_env.setup_every_node(nodes, [p.base_release for p in plans], report)
            with report.busy("launching" + (f", stopping {stopping} run(s)" if stopping else "")):
                answers = launch_everywhere(nodes, run_id, lambda n: one(n, None), report)
            where = " on every node" if names_each_node(nodes) else ""
            report.done(
                f"no changes: release {plans[0].base_release} stays{where} (nothing sent)", 0.0
            )
            return answers, 0.0, t0
        total = sum(a.size for a in archives.values())
        files = sum(len(plans[n.index].diff.changed) for n in todo)
        to = f" to {len(todo)} nodes" if names_each_node(nodes) else ""
        after = (
            "building the releases"
            if streamed
            else "unpacking" + (f", stopping {stopping} run(s)" if stopping else "") + ", launching"
        )

        with report.transfer(total, f"sending {files} files{to}", after) as progress:
            if streamed:
                built = self.build_everywhere(todo, plans, lambda n: one(n, progress))
            else:
                answers = launch_everywhere(nodes, run_id, lambda n: one(n, progress), report)
        if streamed:
            answers = self.setup_then_launch(nodes, plans, params, built)
        synced_s = max(
            time.monotonic()
            - t0
            - max(float(a.get("stop_seconds") or 0.0) + float(a.get("launch_seconds") or 0.0)
                  for a in answers),
            0.0,
        )  # fmt: skip
        self.say_synced(nodes, plans, answers, archives, synced_s)
        return answers, synced_s, t0

    def say_synced(self, nodes, plans, answers, archives, seconds) -> None:
        for node, plan, answer in zip(nodes, plans, answers, strict=True):
            if not plan.new_release:
                continue
            built = cast(dict, answer.get("build") or {})
            built.setdefault("archive_bytes", archives[node.index].size)
            diff = plan.diff
            prefix = f"{node.name}: " if names_each_node(nodes) else ""
            self.report.done(
                f"{prefix}synced {len(diff.changed)} of {len(plan.manifest)} files "
                f"({human_bytes(plan.bytes_to_send)}, {built.get('linked', 0)} reused"
                + (f", {len(diff.removed)} removed" if diff.removed else "")
                + f") into release {plan.new_release}",
                seconds,
            )

    def build_everywhere(self, todo, plans, build) -> dict[int, dict]:
        """`build` on every node with a new release, before any setup or launch; a
        failure anywhere removes the releases built elsewhere and raises, naming the
        node."""
        outcomes = on_every_node(todo, build)
        if any(not o.ok for o in outcomes):
            self.discard([o.node for o in outcomes if o.ok], plans)
        answers = values_or_raise(outcomes, "building the release")
        return {n.index: cast(dict, a["build"]) for n, a in zip(todo, answers, strict=True)}

    def setup_then_launch(self, nodes, plans, params, built) -> list[LaunchAnswer]:
        """The releases are built (nothing stopped yet): stream their setup, then launch
        them everywhere. A failed setup removes the unused releases and stops nothing."""
        try:
            setup_env.setup_every_node(nodes, [p.release for p in plans], self.report)
        except BaseException:
            self.discard([n for n in nodes if plans[n.index].new_release], plans)
            raise
        run_id = params[nodes[0].index]["run_id"]

        def launch(node: Node) -> LaunchAnswer:
            # `expect` was checked by the build; the launch's own check would compare
            # the new release with the old manifest.
            p = {k: v for k, v in params[node.index].items() if k != "expect"}
            answer = stop_and_launch(node.config, node.target, cast(LaunchParams, p))
            if node.index in built:
                answer["build"] = built[node.index]
            return answer

        return launch_everywhere(nodes, run_id, launch, self.report)

    def discard(self, built: list[Node], plans: list[Plan]) -> None:
        """The releases built on these nodes will not be launched: remove them (best
        effort: an unused release is only space, the next deploy's gc removes it)."""

        def remove(node: Node) -> None:
            agent_client.call_agent(
                node.target,
                node.config.container.python,
                "discard",
                {
                    "workdir": node.config.container.workdir,
                    "release": plans[node.index].new_release,
                },
            )

        for outcome in on_every_node(built, remove):
            if not outcome.ok:
                self.report.warning(
                    f"release {plans[outcome.node.index].new_release} stays unused on "
                    f"{outcome.node.describe()}: {outcome.error}"
                )


def node_entry(node: Node, plan: Plan, answer: LaunchAnswer, command, started) -> dict[str, Any]:
    """What a deploy did on one node, for its entry of the JSON summary."""
    built = cast(dict, answer.get("build") or {})
    new = bool(plan.new_release)
    return {
        "node": node.name,
        "node_rank": node.index,
        "release": answer["release"],
        "previous_release": plan.base_release,
        "pid": answer["run"]["pid"],
        "files_sent": len(plan.diff.changed) if new else 0,
        "bytes_sent": plan.bytes_to_send if new else 0,
        "archive_bytes": built.get("archive_bytes", 0) if new else 0,
        # The agent's unpacking and checking of the release, and its CPU time by then.
        "build_seconds": built.get("seconds"),
        "build_cpu_seconds": built.get("cpu_seconds"),
        # What the launch then waited for the trainer's config check, before its stop.
        "check_seconds": answer.get("check_seconds"),
        "files_total": len(plan.manifest),
        "files_removed": len(plan.diff.removed) if new else 0,
        "runs_stopped": answer["stopped"],
        "releases_removed": answer.get("releases_removed", []),
        "command": command,
        "target": node.target.describe(),
        "seconds": round(time.monotonic() - started, 3),
    }
