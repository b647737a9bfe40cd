"""dflashctl status: the container's state and uptime, and the active run if any."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape

from dflashctl import terminal
from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.errors import EXIT_HOST
from dflashctl.json_output import node_name_of
from dflashctl.status_info import collect_status


def print_status(status: dict[str, Any]) -> None:
    out = terminal.out
    container = status["container"]
    if container is None:
        out.print(f"[bold]host[/bold]       {escape(status['target'])} (no container)")
    else:
        state = container["status"]
        colour = "green" if state == "running" else "yellow"
        line = f"[{colour}]{state}[/{colour}]"
        if state == "running":
            line += f", up {terminal.human_duration(container['uptime_s'])}"
        name = f" ({escape(container['name'])})" if container["name"] else ""
        out.print(
            f"[bold]container[/bold]  {container['vmid']}{name} on node "
            f"{escape(status['node'])}: {line}"
        )
    run = status["active_run"]
    if status["active_run_error"]:
        terminal.error(status["active_run_error"]["message"], status["active_run_error"]["hint"])
        return
    if run is None:
        if container is not None and container["status"] != "running":
            out.print("[bold]run[/bold]        unknown while the container is stopped")
        else:
            out.print(f"[bold]run[/bold]        none launched yet in {escape(status['workdir'])}")
        return
    colour = {
        "running": "green",
        "exited": "green" if run["exit_code"] == 0 else "red",
        "stopped": "yellow",
    }.get(run["status"], "red")
    details = [f"[{colour}]{escape(run['state'])}[/{colour}]"]
    if run.get("recovery"):
        details.append(escape(run["recovery"]))
    if run.get("hang"):
        details.append(f"[red]{escape(run['hang'])}[/red]")
    if run["status"] == "running" and run["pid"]:
        details.append(f"pid {run['pid']}")
    if run["started"]:
        details.append(f"started {escape(run['started'])}")
    if run["release"]:
        details.append(f"release {escape(run['release'])}")
    out.print(f"[bold]run[/bold]        {escape(run['id'])}: {', '.join(details)}")


def status(config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Show the container's state, its uptime and the active run (a row per node)."""
    from dflashctl.config import load_config

    loaded = load_config(config)
    if len(loaded.nodes) > 1:
        from dflashctl.fleet.status import status_command

        status_command(loaded, as_json=as_json)
        return
    report = collect_status(loaded)
    if as_json:
        # `node` names the node, as with several; the Proxmox node is `proxmox_node`.
        one = {k: v for k, v in report.items() if k != "node"}
        one["proxmox_node"] = report["node"]
        terminal.print_json(one, command="status", node=node_name_of(loaded))
    else:
        print_status(report)
    if report["active_run_error"]:
        raise typer.Exit(EXIT_HOST)


def register(app: typer.Typer) -> None:
    app.command()(status)
