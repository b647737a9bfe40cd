"""dflashctl doctor: check every link from dflash.yaml to the container, one line each.

Each check passes or fails with a fix; a check that depends on a failed one is shown
as skipped. Exit code 0 when nothing failed, 2 for a config problem, 3 for a
host/SSH/container problem.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Annotated, Any

import typer
from rich.markup import escape

from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.errors import EXIT_OK, ConfigError, UsageError
from dflashctl.ops.doctor_checks import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    Check,
    Doctor,
    source_check,
)
from dflashctl.ui import terminal


def run_checks(config_path: str | None, on_check: Callable[[Check], None]) -> Doctor:
    from dflashctl.config.schema import load_config
    from dflashctl.ops import doctor_nodes
    from dflashctl.ops.launch_command import meet
    from dflashctl.remote.nodes import names_each_node

    doctor = Doctor(on_check)
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        doctor.add(Check("config valid", FAIL, exc.message, exc.hint, True))
        doctor.skip_rest("needs a valid config")
        return doctor
    doctor.add(Check("config valid", PASS, str(config.path)))
    source_check(doctor, config)
    if isinstance(on_check, GroupedPrinter):
        on_check.headings = names_each_node(config.nodes)
    checkups = doctor_nodes.check_every_node(config, doctor)
    try:
        if meet(config.nodes):
            with terminal.spinner("checking the rendezvous"):
                doctor_nodes.check_across_nodes(doctor, config, checkups)
    finally:
        doctor_nodes.close_checkups(checkups)
    return doctor


# --------------------------------------------------------------------------- output

_MARK = {
    PASS: "[green]✓[/green]",
    FAIL: "[bold red]✗[/bold red]",
    SKIP: "[dim]-[/dim]",
    WARN: "[yellow]![/yellow]",
}


def print_check(check: Check, indent: str = "") -> None:
    style = "dim" if check.status == SKIP else ""
    detail = escape(check.detail)
    line = f"{indent}{_MARK[check.status]} {check.name:<20} {f'[{style}]{detail}[/{style}]' if style else detail}"
    terminal.out.print(line)
    if check.status == FAIL and check.fix:
        terminal.out.print(f"{indent}  [dim]fix:[/dim] {escape(check.fix)}")


class GroupedPrinter:
    """print_check, with a heading before each node's checks and before the checks
    across the nodes that follow them (a fleet of one has no headings)."""

    def __init__(self) -> None:
        self._group: str | None = None
        self._grouped = False
        self.headings = False  # set once the config is read

    def __call__(self, check: Check) -> None:
        if self.headings and check.node != self._group:
            heading = f"node {check.node}" if check.node is not None else "across the nodes"
            terminal.out.print(f"[bold]{escape(heading)}[/bold]")
            self._group, self._grouped = check.node, True
        print_check(check, "  " if self._grouped else "")


FixOption = Annotated[
    bool,
    typer.Option(
        "--fix",
        help="First repair the GPU container's breakages (driver libraries, device majors, "
        "nvidia-uvm nodes, /dev/shm), asking once per fix; a pct snapshot before each.",
    ),
]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="With --fix: fix without asking.")]


def doctor(
    config: ConfigOption = None,
    as_json: JsonOption = False,
    fix: FixOption = False,
    yes: YesOption = False,
) -> None:
    """Check the config, SSH, host key, Proxmox, the container, python/torch, GPUs and disk
    (on every node, then whether the nodes reach the rendezvous port and agree)."""
    if fix and as_json:
        raise UsageError(
            "--fix asks and reports on the terminal: run it without --json",
            hint="dflashctl doctor --fix --yes, then dflashctl doctor --json",
        )
    fixing = EXIT_OK
    if fix:
        from dflashctl.commands.doctor_fix import fix_all

        fixing = fix_all(config, yes)  # a refused fix fails doctor even where checks pass
    result = run_checks(config, (lambda check: None) if as_json else GroupedPrinter())
    if as_json:
        terminal.print_json(_doctor_json(result), command="doctor")
    else:
        failed = sum(c.status == FAIL for c in result.checks)
        if failed:
            terminal.error(f"{failed} check{'s' if failed > 1 else ''} failed")
        else:
            terminal.success("all checks passed")
    raise typer.Exit(result.exit_code or fixing)


def _doctor_json(result) -> dict[str, Any]:
    """Each node's checks in its entry of `nodes`; the checks across the nodes (the
    rendezvous port, agreement) and the config's own at the top level."""
    per_node: dict[str, list[dict[str, Any]]] = {}
    across: list[dict[str, Any]] = []
    for check in result.checks:
        data = asdict(check)
        data.pop("config_problem")
        data.pop("node")  # where it ran is its entry of `nodes`
        data["seconds"] = round(check.seconds, 3)
        if check.node is None:
            across.append(data)
        else:
            per_node.setdefault(check.node, []).append(data)
    return {
        "ok": result.exit_code == EXIT_OK,
        "exit_code": result.exit_code,
        "checks": across,
        "nodes": [{"node": name, "checks": checks} for name, checks in per_node.items()],
    }


def register(app: typer.Typer) -> None:
    app.command()(doctor)
