"""dflashctl container create (doctor --fix is commands/doctor_fix.py).

create: the container a run needs, from `container:` in the config (template, storage,
cores, memory, disk, gpus, shm_size, unprivileged), ending with doctor's checks.
--dry-run shows every command and changes nothing; a second run says what already
matches and changes only what differs.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from dflashctl.commands.common import ConfigOption
from dflashctl.errors import EXIT_OK
from dflashctl.ui import terminal

container_app = typer.Typer(no_args_is_help=True)

DryRunOption = Annotated[
    bool, typer.Option("--dry-run", help="Show every command it would run; change nothing.")
]


def _say_plan(plan, dry_run: bool) -> None:
    for line in plan.matches:
        terminal.out.print(f"[green]=[/green] already: {escape(line)}")
    for line in plan.notes:
        terminal.warning(escape(line))
    if dry_run:
        for action in plan.actions:
            terminal.out.print(f"[cyan]+[/cyan] {escape(action.what)}")
            for command in action.commands:
                terminal.out.print(f"    would run: {escape(command)}")


def _apply(plan) -> None:
    for action in plan.actions:
        if action.restarts:
            terminal.info(f"{escape(action.what)} (applies at the container's next start)")
        with terminal.step(escape(action.what)):
            action.apply()


def _create_node(config, target, dry_run: bool) -> int:
    from dflashctl.container import create, host

    gpus = host.probe(target.transport)
    plan, existed = create.node_plan(config, target, gpus)
    _say_plan(plan, dry_run)
    vmid = config.container.vmid
    if dry_run:
        running = existed and create.is_running(target, vmid) and not plan.actions
        inner = (
            create.inside_plan(config, target, gpus)
            if running
            else create.inside_plan_unknown(config, target, gpus)
        )
        _say_plan(inner, True)
        changes = len(plan.actions) + (len(inner.actions) if running else 0)
        terminal.info(f"dry run: {changes or 'no'} change(s) to make; nothing was changed")
        return EXIT_OK
    _apply(plan)
    gpus = host.probe(target.transport)  # the uvm nodes may be new
    inner = create.inside_plan(config, target, gpus)
    _say_plan(inner, False)
    _apply(inner)
    if not plan.actions and not inner.actions:
        terminal.success(f"container {vmid} already is as the config asks: nothing changed")
    return EXIT_OK


def create_command(config: ConfigOption = None, dry_run: DryRunOption = False) -> None:
    """Create the container a run needs from `container:` in the config (or bring an
    existing one in line), with its GPUs passed through, /dev/shm sized, the NVIDIA
    user-space libraries of the host driver's version and torch; then run doctor."""
    from dflashctl.commands.doctor import GroupedPrinter, run_checks
    from dflashctl.config.schema import load_config
    from dflashctl.errors import ConfigError
    from dflashctl.remote.connect import as_host_error
    from dflashctl.remote.nodes import names_each_node, node_sessions

    cfg = load_config(config)
    if any(node.container.vmid is None for node in cfg.node_configs()):
        raise ConfigError(
            "container.vmid is not set: there is no container to create",
            hint="set container.vmid to a free vmid on the node, e.g. 200",
        )
    with node_sessions(cfg) as nodes:
        for node in nodes:
            if names_each_node(nodes):
                terminal.out.print(f"[bold]{escape(node.describe())}[/bold]")
            with as_host_error(node.target):
                _create_node(node.config, node.target, dry_run)
    if dry_run:
        raise typer.Exit(EXIT_OK)
    terminal.info("checking it with doctor:")
    result = run_checks(config, GroupedPrinter())
    if result.exit_code:
        terminal.error("the container was made, but doctor finds problems (above)")
    else:
        terminal.success("container ready: all checks passed")
    raise typer.Exit(result.exit_code)


def register(app: typer.Typer) -> None:
    container_app.command("create")(create_command)
    app.add_typer(container_app, name="container")
