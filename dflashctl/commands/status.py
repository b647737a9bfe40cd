"""dflashctl status: the container's state and uptime, and the active run if any; on
several nodes a row per node, every node asked at once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.errors import HostError
from dflashctl.ui import terminal

if TYPE_CHECKING:
    from dflashctl.remote.nodes import NodeOutcome


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
    for holder in status.get("gpu_holders") or []:  # every live run of the container
        gpus = holder["gpus"]
        held = "every GPU" if gpus is None else "GPU " + ",".join(map(str, gpus))
        out.print(
            f"[bold]gpus[/bold]       {held} held by run {escape(holder['run_id'])} "
            f"({escape(holder['run_dir'])})"
        )
    run = status["active_run"]
    if status["active_run_error"]:  # the command's error says it
        return
    if run is None:
        if container is not None and container["status"] != "running":
            out.print("[bold]run[/bold]        unknown while the container is stopped")
        else:
            out.print(f"[bold]run[/bold]        none launched yet in {escape(status['workdir'])}")
        return
    colour = _colour(run)
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


# On a terminal narrower than this, the table of several nodes leaves out `where`.
WIDE_TABLE = 120


def state_of(report: dict[str, Any]) -> tuple[str, str]:
    """The active run's state in words, and its colour, for a row of the table."""
    container, run = report["container"], report["active_run"]
    if report["active_run_error"]:
        return report["active_run_error"]["message"], "red"
    if run is None:
        stopped = container is not None and container["status"] != "running"
        return ("unknown while the container is stopped" if stopped else "none launched yet"), "dim"
    state = run["state"] + (f", {run['recovery']}" if run.get("recovery") else "")
    state += f", {run['hang']}" if run.get("hang") else ""
    return state, "red" if run.get("hanging") or run.get("hung") else _colour(run)


def _colour(run: dict[str, Any]) -> str:
    """The active run's colour by its status: green running or exited 0, red else."""
    if run["status"] == "running" or (run["status"] == "exited" and run["exit_code"] == 0):
        return "green"
    return "yellow" if run["status"] == "stopped" else "red"


def print_rows(outcomes: list[NodeOutcome[dict[str, Any]]]) -> None:
    """A row per node: where it is, its container, the release, the active run, its state."""
    from dflashctl.remote.nodes import error_text
    from dflashctl.ui.tables import Column, Row, print_table

    rows = []
    for outcome in outcomes:
        node, report = outcome.node, outcome.value
        if report is None:
            cells = [node.name, node.target.describe(), "unreachable", "-", "-"]
            rows.append(Row([*cells, error_text(outcome.error)], "red"))
            continue
        container = report["container"]
        if container is None:
            where_runs = "- (the host)"
        elif container["status"] == "running":
            where_runs = f"running, up {terminal.human_duration(container['uptime_s'])}"
        else:
            where_runs = container["status"]
        run = report["active_run"]
        state, colour = state_of(report)
        cells = [node.name, report["target"], where_runs, report["release"] or "-"]
        rows.append(Row([*cells, run["id"] if run else "-", state], colour))
    # On a narrow terminal `where` goes (--json has it) and the container and release
    # give way; names, run ids and states never do (a long state wraps).
    columns = [
        Column("node", no_wrap=True, min_width=max(len(r.cells[0]) for r in rows)),
        Column("where", no_wrap=True, overflow="ellipsis", narrow_drops=True),
        Column("container", overflow="ellipsis"),
        Column("release", overflow="ellipsis"),
        Column("active run", no_wrap=True, min_width=20),
        Column("state", min_width=17),
    ]
    print_table(columns, rows, title=f"{len(outcomes)} nodes", wide=WIDE_TABLE)


def node_json(outcome: NodeOutcome[dict[str, Any]]) -> dict[str, Any]:
    """A node's status named by its node (its Proxmox node is `proxmox_node`)."""
    from dflashctl.remote.nodes import error_json

    report = dict(outcome.value or {"target": outcome.node.target.describe()})
    proxmox_node = report.pop("node", None)
    return {
        "node": outcome.node.name,
        **report,
        "proxmox_node": proxmox_node,
        "error": error_json(outcome.error),
    }


def status(config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Show the container's state, its uptime and the active run (a row per node)."""
    from dflashctl.config.schema import load_config
    from dflashctl.ops.status import status_of_every_node
    from dflashctl.remote.nodes import NodeOutcome, fleet_failure, names_each_node, nobody_answered

    outcomes = status_of_every_node(load_config(config))
    failure = fleet_failure(outcomes, "status")
    if failure is not None and nobody_answered(outcomes):
        raise failure
    if as_json:
        terminal.print_json({"nodes": [node_json(o) for o in outcomes]}, command="status")
    elif names_each_node(outcomes):
        print_rows(outcomes)
    else:
        print_status(outcomes[0].value)
    if failure is not None:
        raise failure
    # A container that answered, its runs unread: that node failed its status.
    unread = [
        NodeOutcome(o.node, o.value, HostError(**o.value["active_run_error"]))
        if o.value and o.value["active_run_error"]
        else o
        for o in outcomes
    ]
    failure = fleet_failure(unread, "status")
    if failure is not None:
        raise failure


def register(app: typer.Typer) -> None:
    app.command()(status)
