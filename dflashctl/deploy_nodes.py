"""deploy across several nodes: all or nothing.

  1. inspect   every node at once: its current release and manifest, runs to stop
  2. build     every node at once: the changed files streamed to it, the release
               built and verified there (the agent's `build` verb); nothing stopped
  3. launch    only when every node has the release: stop, swap, start on every node
               at once, as one torchrun job (launch_nodes.py)

A failure in 1 or 2 on any node stops nothing anywhere: the error names the node, and
the releases already built on the others are removed again. One SSH connection per
host carries all of it (dflashctl/nodes.py); every node gets the same release id and
the same run id.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

from dflashctl import agent_client, releases, runs, terminal
from dflashctl.agent_messages import LaunchAnswer
from dflashctl.archive import Archive
from dflashctl.config import Config
from dflashctl.crash import rules_for
from dflashctl.deploy import (
    DeployOptions,
    Plan,
    check_source,
    confirm_size,
    inspect,
    plan_from,
    print_plan,
    upload_and_deploy,
)
from dflashctl.errors import DflashError
from dflashctl.launch_nodes import (
    launch_everywhere,
    node_command,
    nodes_summary,
    print_nodes_launched,
    rendezvous_endpoint,
)
from dflashctl.launching import follow_unless_detached, lock_holder, source_meta
from dflashctl.nodes import Node, node_sessions, on_every_node, values_or_raise


def deploy_nodes(config: Config, options: DeployOptions) -> tuple[int, dict[str, Any]]:
    """Run a deploy on every node; returns (exit code, the JSON summary)."""
    started = time.monotonic()
    rules = rules_for(config)
    manifest, skipped = check_source(config)
    with node_sessions(config) as nodes:
        plans = _plans(config, nodes, options, manifest)
        if options.dry_run:
            return 0, _print_plans(nodes, plans)
        confirm_size(config, max(plans, key=lambda p: p.bytes_to_send), yes=options.yes)
        rendezvous = rendezvous_endpoint(config, nodes)
        built = _build_everywhere(config, nodes, plans)
        _setup_everywhere(config, nodes, plans)
        meta = source_meta(config)
        run_id = runs.new_id()
        answers, endpoint, seconds = launch_everywhere(
            config,
            nodes,
            run_id,
            [plan.release for plan in plans],
            rendezvous,
            meta,
            extra_args=options.extra_args,
            fresh=options.fresh,
            by="deploy",
            wait=options.wait,
        )
        for node, answer in zip(nodes, answers, strict=True):
            releases.save_last_deploy(node.config, answer["release"], manifest)
        print_nodes_launched(nodes, answers, run_id, endpoint, seconds)
        summary = nodes_summary(nodes, answers, run_id, endpoint)
        for entry, plan, build in zip(summary["nodes"], plans, built, strict=True):
            entry.update(
                previous_release=plan.base_release,
                files_sent=len(plan.diff.changed) if plan.new_release else 0,
                bytes_sent=plan.bytes_to_send if plan.new_release else 0,
                build=build,
            )
        summary.update(
            left_out=skipped.names(),
            files_total=len(manifest),
            seconds=round(time.monotonic() - started, 3),
            dry_run=False,
        )
        return follow_unless_detached(nodes, rules, summary, detach=options.detach)


def _plans(config: Config, nodes: list[Node], options: DeployOptions, manifest: Any) -> list[Plan]:
    """Round trip 1 on every node at once; one release id for the nodes that need one."""
    may_start = options.start_container and not options.dry_run

    def plan(node: Node) -> Plan:
        start = may_start or (node.config.container.start_if_stopped and not options.dry_run)
        state = inspect(node.config, node.target, may_start=start)
        planned = plan_from(
            node.config,
            options,
            manifest,
            state.get("release"),
            state.get("manifest"),
            state.get("to_stop"),
        )
        # What the dry run shows; the real one is made at launch, with the address.
        where = (config.torchrun.address or "<first node's address>", config.torchrun.port)
        planned.command = node_command(
            config, node, len(nodes), where, "<run id>", options.extra_args
        )
        return planned

    with terminal.step(f"inspecting {len(nodes)} nodes") as step:
        plans = values_or_raise(on_every_node(nodes, plan), "inspecting")
        release_id = runs.new_id()
        for p in plans:
            if p.new_release:
                p.new_release = release_id
        bases = {p.base_release for p in plans}
        step["done"] = f"inspected {len(nodes)} nodes: " + (
            f"release {bases.pop()} on each"
            if len(bases) == 1 and None not in bases
            else ", ".join(
                f"{n.name} {p.base_release or 'nothing deployed'}"
                for n, p in zip(nodes, plans, strict=True)
            )
        )
    return plans


def _build_everywhere(config: Config, nodes: list[Node], plans: list[Plan]) -> list[dict]:
    """Round trip 2 on every node that needs a new release, at once; a failure anywhere
    removes the releases built elsewhere and raises, naming the node."""
    todo = [n for n, p in zip(nodes, plans, strict=True) if p.new_release]
    if not todo:
        terminal.step_done(
            f"no changes: release {plans[0].base_release} stays on every node (nothing sent)",
            0.0,
        )
        return [{} for _ in nodes]
    source = Path(config.trainer.source)
    archives = {
        n.index: Archive.of_release(source, plans[n.index].manifest, plans[n.index].diff.changed)
        for n in todo
    }
    total = sum(a.size for a in archives.values())
    files = sum(len(plans[n.index].diff.changed) for n in todo)
    t0 = time.monotonic()

    def build(node: Node, progress) -> LaunchAnswer:
        plan = plans[node.index]
        # What the agent's build takes (no run is launched: nothing to stop, no grace).
        params = {
            "workdir": node.config.container.workdir,
            "holder": lock_holder("deploy"),
            "wait": plan.wait,
            "grace_s": 0.0,
        }
        return upload_and_deploy(
            node.config, node.target, plan, archives[node.index], params, progress, verb="build"
        )

    with terminal.transfer(
        total, f"sending {files} files to {len(todo)} nodes", "building the releases"
    ) as progress:
        outcomes = on_every_node(todo, lambda node: build(node, progress))
    if any(not o.ok for o in outcomes):
        _discard(config, [o.node for o in outcomes if o.ok], plans)
    answers = values_or_raise(outcomes, "building the release")
    release = next(p.new_release for p in plans if p.new_release)
    terminal.step_done(
        f"built release {release} on {len(todo)} nodes ("
        + ", ".join(
            f"{n.name}: {len(plans[n.index].diff.changed)} files sent, "
            f"{cast(dict, a['build']).get('linked', 0)} reused"
            for n, a in zip(todo, answers, strict=True)
        )
        + ")",
        time.monotonic() - t0,
    )
    by_index = {n.index: cast(dict, a["build"]) for n, a in zip(todo, answers, strict=True)}
    return [by_index.get(n.index, {}) for n in nodes]


def _setup_everywhere(config: Config, nodes: list[Node], plans: list[Plan]) -> None:
    """Each node's venv for its new release, before anything is stopped; a failure
    anywhere removes the new releases and stops nothing."""
    from dflashctl import setup_env

    try:
        setup_env.setup_every_node(nodes, [plan.release for plan in plans])
    except DflashError:
        _discard(config, [n for n in nodes if plans[n.index].new_release], plans)
        raise


def _discard(config: Config, built: list[Node], plans: list[Plan]) -> None:
    """Another node failed: the releases built on these are not launched; remove them."""

    def discard(node: Node) -> None:
        agent_client.call_agent(
            node.target,
            node.config.container.python,
            "discard",
            {"workdir": node.config.container.workdir, "release": plans[node.index].new_release},
        )

    for outcome in on_every_node(built, discard):
        if not outcome.ok:
            terminal.warning(
                f"release {plans[outcome.node.index].new_release} stays unused on "
                f"{outcome.node.describe()}: {outcome.error}"
            )


def _print_plans(nodes: list[Node], plans: list[Plan]) -> dict[str, Any]:
    out = []
    for node, plan in zip(nodes, plans, strict=True):
        terminal.out.print(f"[bold]{node.describe()}[/bold] (node rank {node.index})")
        out.append({"node": node.name, **print_plan(node.config, plan)})
    return {"dry_run": True, "nodes": out}
