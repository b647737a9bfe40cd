"""`dflashctl status` on several nodes: one row per node (where it is, its container,
the release, the active run and its state), every node asked at once."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from dflashctl import terminal
from dflashctl.config import Config
from dflashctl.errors import HostError
from dflashctl.fleet.errors import error_json, error_text, first_failure
from dflashctl.nodes import Node, NodeOutcome, node_sessions, on_every_node

WIDE_TABLE = 120  # terminal columns: narrower, the table leaves out `where`
HEADERS = ("node", "where", "container", "release", "active run", "state")


def _node_status(node: Node) -> dict[str, Any]:
    from dflashctl.connect import open_proxmox
    from dflashctl.status_info import node_status

    api = open_proxmox(node.config, node.target.transport)
    return node_status(node.config, api, node.target)


def collect(config: Config) -> list[NodeOutcome[dict[str, Any]]]:
    with node_sessions(config) as nodes:
        return on_every_node(nodes, _node_status)


def row(outcome: NodeOutcome[dict[str, Any]]) -> tuple[list[str], str]:
    """The row's cells and the colour of its state."""
    node = outcome.node
    report = outcome.value
    if report is None:
        return [node.name, node.target.describe(), "unreachable", "-", "-",
                error_text(outcome.error)], "red"  # fmt: skip
    container = report["container"]
    if container is None:
        where_runs = "- (the host)"
    elif container["status"] == "running":
        where_runs = f"running, up {terminal.human_duration(container['uptime_s'])}"
    else:
        where_runs = container["status"]
    run = report["active_run"]
    colour = "dim"
    if report["active_run_error"]:
        state, colour = report["active_run_error"]["message"], "red"
    elif run is None:
        stopped = container is not None and container["status"] != "running"
        state = "unknown while the container is stopped" if stopped else "none launched yet"
    else:
        state = run["state"] + (f", {run['recovery']}" if run.get("recovery") else "")
        state += f", {run['hang']}" if run.get("hang") else ""
        colour = {
            "running": "green",
            "exited": "green" if run["exit_code"] == 0 else "red",
            "stopped": "yellow",
        }.get(run["status"], "red")
        colour = "red" if run.get("hanging") else colour
    cells = [
        node.name,
        report["target"],
        where_runs,
        report["release"] or "-",
        run["id"] if run else "-",
        state,
    ]
    return cells, colour


def print_rows(outcomes: list[NodeOutcome[dict[str, Any]]]) -> None:
    rows = [row(o) for o in outcomes]
    if terminal.out.is_terminal:
        from rich.table import Table

        table = Table(title=f"{len(outcomes)} nodes", title_justify="left")
        # On a narrow terminal `where` goes (--json has it) and the container and release
        # give way; names, run ids and states never do (a long state wraps).
        wide = terminal.out.width >= WIDE_TABLE
        table.add_column(HEADERS[0], no_wrap=True, min_width=max(len(c[0]) for c, _ in rows))
        if wide:
            table.add_column(HEADERS[1], no_wrap=True, overflow="ellipsis")
        table.add_column(HEADERS[2], overflow="ellipsis")
        table.add_column(HEADERS[3], overflow="ellipsis")
        table.add_column(HEADERS[4], no_wrap=True, min_width=20)
        table.add_column(HEADERS[5], min_width=17)
        for cells, colour in rows:
            state = f"[{colour}]{escape(cells[-1])}[/{colour}]"
            shown = cells[:-1] if wide else [cells[0], *cells[2:-1]]
            table.add_row(*(escape(c) for c in shown), state)
        terminal.out.print(table)
        return
    lines = [list(HEADERS)] + [cells for cells, _ in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADERS) - 1)]
    for line in lines:
        texts = [cell.ljust(width) for cell, width in zip(line[:-1], widths, strict=True)]
        terminal.out.print("  ".join([*texts, line[-1]]), markup=False)


def _node_json(outcome: NodeOutcome[dict[str, Any]]) -> dict[str, Any]:
    """The one-node status (its Proxmox node as `proxmox_node`), named by its node."""
    report = dict(outcome.value or {"target": outcome.node.target.describe()})
    proxmox_node = report.pop("node", None)
    return {
        "node": outcome.node.name,
        **report,
        "proxmox_node": proxmox_node,
        "error": error_json(outcome.error),
    }


def status_command(config: Config, *, as_json: bool) -> None:
    outcomes = collect(config)
    if as_json:
        terminal.print_json({"nodes": [_node_json(o) for o in outcomes]}, command="status")
    else:
        print_rows(outcomes)
    failure = first_failure(outcomes, "status")
    if failure is not None:
        raise failure
    unreadable = [o for o in outcomes if o.value and o.value["active_run_error"]]
    if unreadable:  # the container answered, the runs could not be read
        problem = unreadable[0].value["active_run_error"]
        raise HostError(
            f"{unreadable[0].node.describe()} status: {problem['message']}", hint=problem["hint"]
        )
