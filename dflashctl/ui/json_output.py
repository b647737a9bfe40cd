"""The one shape of every `--json` answer, for one node and for several:

    {"schema_version": 1, "command": "stop", "nodes": [{"node": "pve", ...}, ...], ...}

one JSON object on one line of stdout. What belongs to the run as a whole (its id, the
follow result's status, doctor's verdict) sits at the top level; what each node did or
said sits in its entry of `nodes`, with `node` (its name) and `error` (null, or the
message and hint of what failed there). The schemas of these objects are in
dflashctl/schemas/ (made from ui/json_schemas.py's models).

Commands hand over their answer with `nodes` (every node's entry, one node's too) and
the run's keys beside it; `document` adds the envelope.
"""

from __future__ import annotations

from typing import Any

SCHEMA_VERSION = 1

# Every command that answers --json.
COMMANDS = (
    "stop",
    "status",
    "runs",
    "runs show",
    "doctor",
    "deploy",
    "logs",
    "restart",
    "pull",
    "stacks",
)
# The run's keys of a classified log file's result (follow/report.py writes it flat,
# beside the file's own), and the fleet's keys such a result lacks. A followed run's
# (follow/fleet_report.py) comes with `nodes`, every node's exit code in its entry.
FOLLOW_RUN_KEYS = ("run", "status", "exit_code", "interrupted", "root_cause", "consequences")
FOLLOW_DEFAULTS: dict[str, Any] = {"root_cause": None, "consequences": []}


def document(command: str, data: dict[str, Any], node: str | None = None) -> dict[str, Any]:
    """`data` (with `nodes`: each node's entry; the run's keys beside it) in the common
    shape; `node`: the one node's name of a follow result written flat."""
    if not isinstance(data.get("nodes"), list):  # a follow result, written flat
        entry = {k: v for k, v in data.items() if k not in FOLLOW_RUN_KEYS}
        run = {k: v for k, v in data.items() if k in FOLLOW_RUN_KEYS}
        data = {**run, "nodes": [{"node": node, **entry}]}
        if command == "logs":  # a classified log file's: the keys a followed run's has
            data = {**FOLLOW_DEFAULTS, **data}
    top = {k: v for k, v in data.items() if k != "nodes"}
    nodes = [{"error": None, **entry} for entry in data["nodes"]]
    if isinstance(top.get("result"), dict):  # a deploy's or restart's follow result
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


def command_in(argv: list[str]) -> str | None:
    """The command an argument list runs (`runs show` included), for the error answer of
    a command that failed before it could answer itself."""
    mine = argv[: argv.index("--")] if "--" in argv else argv
    words = [word for word in mine if not word.startswith("-")]
    for at, word in enumerate(words):
        if word == "runs" and "show" in words[at + 1 :]:
            return "runs show"
        if word in COMMANDS:
            return word
    return None
