"""A deploy's plan on each node: the local checks of the source, round trip 1
(inspect) where this machine does not remember the last deploy, and the dry run's
answer (as data: commands/deploy.py draws it). deploy.py carries the plans out."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from dflashctl.config.schema import Config
from dflashctl.errors import UsageError
from dflashctl.humanize import human_bytes
from dflashctl.ops import setup_env, sync
from dflashctl.ops.launch_command import meet, node_command
from dflashctl.ops.launching import planned_train_steps, trainer_command
from dflashctl.ops.source_cache import SourceCache
from dflashctl.ops.stop import process_scope
from dflashctl.remote import agent_client, pct
from dflashctl.remote.agent_messages import InspectAnswer, ProcessToStop, Resume
from dflashctl.remote.connect import open_proxmox
from dflashctl.remote.nodes import Node, names_each_node, on_every_node, values_or_raise
from dflashctl.reporting import SILENT, Reporter
from dflashctl.runs import records as runs

if TYPE_CHECKING:
    from dflashctl.remote.deploy_target import Target


# --------------------------------------------------------------------------- the target


def inspect(
    config: Config, target: Target, *, may_start: bool, report: Reporter = SILENT
) -> InspectAnswer:
    """Round trip 1; starts a stopped container first when allowed (else exit 3)."""
    params = {
        "workdir": config.container.workdir,
        "entry": config.trainer.entry,
        "scope": process_scope(config),
    }

    def ask() -> InspectAnswer:
        answer = agent_client.call_agent(target, config.container.python, "inspect", params)
        return cast(InspectAnswer, answer)

    try:
        return ask()
    except pct.ContainerNotRunning:
        if not may_start:
            raise  # with pct.not_running_hint, the one hint for a stopped container
    from dflashctl.remote import proxmox

    with report.step(f"starting container {target.vmid}") as step:
        # Through the Proxmox API (pvesh over this connection, or HTTPS with a token),
        # waiting until it runs.
        api = open_proxmox(config, target.transport)
        status = proxmox.start_container(
            api, config.proxmox.node, target.vmid, timeout=config.proxmox.start_timeout_s
        )
        step["done"] = f"started container {target.vmid}"
    if status.warnings:
        report.warning(f"container {target.vmid} started with warnings: {status.warnings}")
    return ask()


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
        return sum(sync.sent_size(self.manifest[p]) for p in self.diff.changed)

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


def check_source(config: Config, report: Reporter = SILENT) -> tuple[sync.Manifest, sync.Skipped]:
    """preflight as a step of a deploy: its line, and one line naming what
    trainer.exclude left out."""
    with report.step("checking the trainer source") as step:
        manifest, checked, skipped = preflight(config)
        step["done"] = (
            f"checked {config.trainer.source}: {len(manifest)} files, {checked} Python files compile"
        )
    left_out = skipped.describe(human_bytes)
    if left_out:
        report.info(f"  {left_out}")
    return manifest, skipped


def confirm_size(config: Config, plan: Plan, *, yes: bool, report: Reporter = SILENT) -> None:
    """More than trainer.confirm_above_mb to send: ask the user (on a terminal);
    with nobody to ask only --yes sends it. Refusing is exit 2 with nothing sent."""
    limit = config.trainer.confirm_above_mb
    size = plan.bytes_to_send if plan.new_release else 0
    if yes or limit is None or size <= limit * 1e6:
        return
    largest = sorted(plan.diff.changed, key=lambda p: -sync.sent_size(plan.manifest[p]))[:3]
    what = ", ".join(f"{p} ({human_bytes(sync.sent_size(plan.manifest[p]))})" for p in largest)
    question = (
        f"this deploy sends {human_bytes(size)}, more than "
        f"trainer.confirm_above_mb ({limit:g} MB); largest: {what}"
    )
    hint = "leave big files out with trainer.exclude, or raise trainer.confirm_above_mb"
    answer = report.confirm(f"{question}. Send it?")
    if answer is None:
        raise UsageError(f"{question}; nothing was sent", hint=f"pass --yes to send it, {hint}")
    if not answer:
        raise UsageError("nothing was sent", hint=hint)


@dataclass
class DeployOptions:
    detach: bool = False
    dry_run: bool = False
    start_container: bool = False
    fresh: bool = False  # start at step 0, not from the replaced run's checkpoint
    wait: bool = False  # queue behind a deploy in flight instead of being refused
    extra_args: list[str] = field(default_factory=list)
    yes: bool = False  # send more than trainer.confirm_above_mb without asking


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


def make_plans(
    config: Config,
    nodes: list[Node],
    options: DeployOptions,
    manifest: sync.Manifest,
    lasts: list[Any],
    report: Reporter = SILENT,
) -> list[Plan]:
    """Each node's plan: from the last deploy there when remembered, else inspected
    (round trip 1, on every such node at once). One release id for every node that
    needs a new release."""
    todo = [n for n in nodes if lasts[n.index] is None]
    inspected: dict[int, Plan] = {}
    if todo:
        what = f"{len(todo)} nodes" if names_each_node(nodes) else todo[0].target.describe()
        with report.step(f"inspecting {what}") as step:
            found = values_or_raise(
                on_every_node(todo, lambda node: inspected_plan(node, options, manifest, report)),
                "inspecting",
            )
            inspected = {n.index: p for n, (p, _) in zip(todo, found, strict=True)}
            step["done"] = "; ".join(said for _, said in found)
    plans = [
        inspected.get(n.index)
        or plan_from(n.config, options, manifest, lasts[n.index].release, lasts[n.index].manifest)
        for n in nodes
    ]
    release_id = runs.new_id()
    for node, plan in zip(nodes, plans, strict=True):
        if plan.new_release:
            plan.new_release = release_id
        if meet(nodes):  # what the dry run shows; the launch makes it with the address
            where = (config.torchrun.address or "<first node's address>", config.torchrun.port)
            plan.command = node_command(
                config, node, len(nodes), where, "<run id>", options.extra_args
            )
    return plans


def inspected_plan(
    node: Node, options: DeployOptions, manifest: sync.Manifest, report: Reporter = SILENT
) -> tuple[Plan, str]:
    """Round trip 1 on a node whose last deploy is unknown or out of date; the plan and
    what to say of it."""
    config, target = node.config, node.target
    state = inspect(
        config,
        target,
        # A dry run changes nothing, a stopped container included.
        may_start=(options.start_container or config.container.start_if_stopped)
        and not options.dry_run,
        report=report,
    )
    base = state.get("release")
    plan = plan_from(config, options, manifest, base, state.get("manifest"), state.get("to_stop"))
    plan.active_run = state.get("active_run")
    plan.continues = state.get("continues")
    running = [t for t in plan.to_stop if t.get("kind") == "active"]
    said = (
        f"inspected {target.describe()}: "
        + (f"release {base}" if base else "nothing deployed yet")
        + (f", run {running[0]['run_id']} running" if running else "")
        + f", python {state.get('python')}"
    )
    return plan, said


def dry_run_summary(nodes: list[Node], plans: list[Plan]) -> dict[str, Any]:
    """The dry run's answer, as data: each node's plan. Nothing was changed."""
    entries = [
        {"node": node.name, "node_rank": node.index, **planned(node, plan)}
        for node, plan in zip(nodes, plans, strict=True)
    ]
    return {"dry_run": True, "release": plans[0].new_release, "nodes": entries}


def planned(node: Node, plan: Plan) -> dict[str, Any]:
    """What would travel, stop and start on one node."""
    config, diff, new = node.config, plan.diff, bool(plan.new_release)
    setup = setup_env.setup_params(config)
    return {
        "target": node.target.describe(),
        "workdir": config.container.workdir,
        "release": plan.new_release,
        "previous_release": plan.base_release,
        "files_total": len(plan.manifest),
        "files_to_send": [
            {"path": p, "size": sync.sent_size(plan.manifest[p])} for p in diff.changed
        ]
        if new
        else [],
        "files_removed": diff.removed if new else [],
        "bytes_to_send": plan.bytes_to_send if new else 0,
        "runs_to_stop": plan.to_stop,
        "stop_grace_s": config.run.stop_grace_s,
        "setup": (
            ([f"pip install -r {setup['requirements']}"] if setup["requirements"] else [])
            + list(setup["commands"])
            if setup
            else []
        ),
        "command": plan.command,
        "fresh": plan.fresh,
        "continues": None if plan.fresh else plan.continues,
        "replaces_run": plan.active_run,
        # As the trainer will read it (None: not known here), for a finished run's plan.
        "train_steps": planned_train_steps(plan.command, Path(config.trainer.source)),
    }
