"""Reading a `--json` answer (dflashctl/ui/json_output.py's shape) in tests: `flat` gives
one node's answer as one dict, its node's keys beside the run-level ones; `one_node` reads
the summary deploy() and restart() return (the same shape, without the envelope) so."""

from __future__ import annotations

from typing import Any


def flat(answer: dict[str, Any]) -> dict[str, Any]:
    """One node: its entry of `nodes` merged with the run-level keys (`node` and a null
    `error` left out). Several nodes: the run-level keys and `nodes` as they are. A
    deploy's follow `result` is read the same way; doctor's checks become one list,
    each node's with its `node` when there are several."""
    assert answer["schema_version"] == 1, answer
    nodes = answer["nodes"]
    top = {k: v for k, v in answer.items() if k not in ("schema_version", "command", "nodes")}
    if isinstance(top.get("result"), dict) and "nodes" in top["result"]:
        top["result"] = flat({"schema_version": 1, **top["result"]})
    if answer.get("command") == "doctor":
        checks = list(top.get("checks", []))
        for node in nodes:
            for check in node["checks"]:
                checks.append({**check, "node": node["node"]} if len(nodes) > 1 else check)
        return {**top, "checks": checks}
    if len(nodes) == 1:
        entry = {k: v for k, v in nodes[0].items() if k != "node"}
        if entry.get("error") is None:
            entry.pop("error", None)
        return {**entry, **top}
    return {**top, "nodes": nodes}


def one_node(summary: dict[str, Any]) -> dict[str, Any]:
    """A one-node deploy's or restart's own summary (ops' return value, not --json):
    its node's entry beside the run's keys, as `flat` reads an answer."""
    assert len(summary["nodes"]) == 1, summary
    return flat({"schema_version": 1, **summary})
