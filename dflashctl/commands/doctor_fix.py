"""dflashctl doctor --fix: the GPU container's breakages, found and repaired with consent
(--yes, or one question per fix), each after a pct snapshot where the storage can take
one; a refused fix changes nothing."""

from __future__ import annotations

import typer
from rich.markup import escape

from dflashctl.errors import EXIT_HOST, EXIT_OK
from dflashctl.ui import terminal


def _ask(question: str, yes: bool) -> bool:
    if yes:
        return True
    try:
        return typer.confirm(question, default=False, err=True)
    except (typer.Abort, EOFError):
        return False


def _apply(found, target, vmid: int, yes: bool) -> tuple[int, int, bool]:
    """Offer each finding's fix, a snapshot of container `vmid` before each change, then
    restart the container when a fix needs it: (fixed, left, whether it restarted)."""
    from dflashctl.container import repair

    fixed = left = 0
    restart_needed = False
    for number, finding in enumerate(found, 1):
        terminal.out.print(
            f"[bold red]✗[/bold red] {escape(finding.name)}: {escape(finding.problem)}"
        )
        terminal.out.print(f"  [dim]fix:[/dim] {escape(finding.fix)}")
        if finding.apply is None:
            left += 1
            continue
        if finding.restarts:
            terminal.out.print(
                "  [yellow]the container restarts after the fixes for this to apply[/yellow]"
            )
        if not _ask(f"fix '{finding.name}' in container {vmid}?", yes):
            terminal.info("  left as it is")
            left += 1
            continue
        if finding.changes_container:
            name = repair.snapshot(target, vmid, number)
            if name is None:
                terminal.warning(
                    f"no snapshot: the storage of container {vmid} cannot take one "
                    f"({repair.NO_SNAPSHOT}); undo by hand"
                )
            else:
                terminal.info(
                    f"  snapshot {name} taken; roll back with: pct rollback {vmid} {name}"
                )
        finding.apply()
        terminal.success(f"fixed: {escape(finding.name)}")
        fixed += 1
        restart_needed = restart_needed or finding.restarts
    if restart_needed:
        from dflashctl.container.create import is_running, run_pct

        if is_running(target, vmid):
            terminal.info(f"restarting container {vmid} so that the fixes apply")
            run_pct(target, ["pct", "stop", str(vmid)])
        run_pct(target, ["pct", "start", str(vmid)])
    return fixed, left, restart_needed


def fix_node(config, target, yes: bool) -> tuple[int, int]:
    """Find the breakages of one node's container and fix those the user agrees to:
    (fixed, left) counts."""
    from dflashctl.container import repair

    vmid = config.container.vmid
    seen = repair.survey(config, target)
    found = repair.findings(config, target, seen)
    if not found:
        terminal.success(f"container {vmid}: nothing to fix")
        return 0, 0
    fixed, left, _ = _apply(found, target, vmid, yes)
    return fixed, left


def fix_split(group, yes: bool) -> int:
    """Ranks of one host in several containers: the first gets every GPU (after a
    snapshot of it); the others are left as they are. The fixes left."""
    from dflashctl.container import split

    first = group[0]
    vmid = first.config.container.vmid
    _, left, restarted = _apply([split.finding(group)], first.target, vmid, yes)
    if restarted:
        terminal.warning(
            f"container {vmid} now has every GPU of the host; change the config as the fix "
            "line says (one node there), or the ranks stay split"
        )
    return left


def fix_all(config_path: str | None, yes: bool) -> int:
    """doctor --fix before its checks: the exit code of the fixing (3 when a fix was
    refused or has no automatic form)."""
    from dflashctl.config.schema import load_config
    from dflashctl.container import split
    from dflashctl.remote.connect import as_host_error
    from dflashctl.remote.nodes import node_sessions

    cfg = load_config(config_path)
    left = 0
    with node_sessions(cfg) as nodes:
        for group in split.split_groups(nodes):
            with as_host_error(group[0].target):
                left += fix_split(group, yes)
        for node in nodes:
            if node.config.container.vmid is None:
                continue
            with as_host_error(node.target):
                _, node_left = fix_node(node.config, node.target, yes)
            left += node_left
    return EXIT_HOST if left else EXIT_OK
