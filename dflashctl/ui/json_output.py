"""The one shape of every `--json` answer, for one node and for several:

    {"schema_version": 1, "command": "stop", "nodes": [{"node": "pve", ...}, ...], ...}

one JSON object on one line of stdout. What belongs to the run as a whole (its id, the
follow result's status, doctor's verdict) sits at the top level; what each node did or
said sits in its entry of `nodes`, with `node` (its name) and `error` (null, or the
message and hint of what failed there). The schemas of these objects are in
dflashctl/schemas/ (made from ui/json_schemas.py's models).

Commands hand over what they have, in either of the shapes they produce (a one-node
dict, or a dict that already has `nodes`); `document` puts it into this one.
"""

from __future__ import annotations

from typing import Any

SCHEMA_VERSION = 1

# The keys of each command's answer that describe the run, not one node.
RUN_LEVEL: dict[str, tuple[str, ...]] = {
    "stop": (),
    "status": (),
    "runs": (),
    "runs show": (),
    "doctor": ("ok", "exit_code", "checks"),
    "deploy": (
        "run_id",
        "release",
        "rendezvous",
        "resumed_from",
        "resumed_step",
        "resumed_checkpoint",
        "replaced_run",
        "dry_run",
        "result",
        "start",
    ),
    "logs": ("run", "status", "exit_code", "interrupted", "root_cause", "consequences"),
}
RUN_LEVEL["restart"] = RUN_LEVEL["deploy"]
# pull: what was copied and where to is the run's; the node it came from is in `nodes`.
RUN_LEVEL["pull"] = (
    "run_id",
    "to",
    "checkpoint",
    "export",
    "files",
    "fetched",
    "resumed",
    "already",
    "bytes",
)
RUN_LEVEL["stacks"] = ()  # every node's ranks answer for themselves
COMMANDS = tuple(RUN_LEVEL)


def document(command: str, data: dict[str, Any], node: str | None = None) -> dict[str, Any]:
    """`data` (one node's answer, or one with `nodes` already) in the common shape;
    `node`: the one node's name when `data` has no `nodes`."""
    run_level = RUN_LEVEL[command]
    if isinstance(data.get("nodes"), list):
        top = {k: v for k, v in data.items() if k != "nodes"}
        nodes = [dict(entry) for entry in data["nodes"]]
    else:
        top = {k: v for k, v in data.items() if k in run_level}
        entry = {k: v for k, v in data.items() if k not in run_level}
        nodes = [{"node": entry.pop("node", None) or node, **entry}]
    for entry in nodes:
        entry.setdefault("error", None)
    if command in ("deploy", "restart") and isinstance(top.get("result"), dict):
        # The follow result of one node is shaped like the one of several.
        top["result"] = document("logs", top["result"], nodes[0]["node"])
        top["result"].pop("schema_version", None)
        top["result"].pop("command", None)
    return {"schema_version": SCHEMA_VERSION, "command": command, "nodes": nodes, **top}


def error_document(
    message: str,
    exit_code: int,
    hint: str | None,
    command: str | None = None,
    nodes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A command that failed before it had an answer: no node answered, or (a launch
    across nodes that failed) `nodes` says what each node left."""
    return {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "nodes": nodes or [],
        "error": message,
        "exit_code": exit_code,
        "hint": hint,
    }


def node_name_of(config: Any) -> str | None:
    """The one node's name in a config (as its entry of `nodes` names it)."""
    nodes = getattr(config, "nodes", None) or []
    return nodes[0].label() if len(nodes) == 1 else None


def command_in(argv: list[str]) -> str | None:
    """The command an argument list runs (`runs show` included), for the error answer of
    a command that failed before it could answer itself."""
    mine = argv[: argv.index("--")] if "--" in argv else argv
    words = [word for word in mine if not word.startswith("-")]
    for at, word in enumerate(words):
        if word == "runs" and "show" in words[at + 1 :]:
            return "runs show"
        if word in RUN_LEVEL:
            return word
    return None
