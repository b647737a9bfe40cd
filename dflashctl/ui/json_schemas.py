"""The `--json` answers as pydantic models; their JSON Schemas are kept in
dflashctl/schemas/<command>.json (regenerate with `make schemas`, i.e.
`python -m dflashctl.ui.json_schemas`; a test checks the kept files match these models).

Every answer is an Envelope (ui/json_output.py): `schema_version`, `command`, `nodes` and
the command's run-level keys; or, when the command failed before it could answer, an
ErrorAnswer. Objects allow more keys than listed (a new key is not a breaking change);
the listed ones are always there, with these types.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from dflashctl.ui.json_output import COMMANDS, SCHEMA_VERSION

SCHEMA_DIR = Path(__file__).parent.parent / "schemas"


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class NodeError(Open):
    message: str
    hint: str | None


class NodeEntry(Open):
    node: str | None = Field(description="the node's name (null: a local file, for logs)")
    error: NodeError | str | None = Field(description="what failed on this node, or null")


class Envelope(Open):
    schema_version: Literal[1] = SCHEMA_VERSION
    command: str
    nodes: list[NodeEntry]


class ErrorAnswer(Open):
    """A command that failed before any node answered."""

    schema_version: Literal[1] = SCHEMA_VERSION
    command: str | None
    nodes: list[NodeEntry] = Field(max_length=0)
    error: str
    exit_code: int
    hint: str | None


# --------------------------------------------------------------------------- per command


class StopNode(NodeEntry):
    target: str
    stopped: list[dict[str, Any]]


class StopAnswer(Envelope):
    command: Literal["stop"]
    nodes: list[StopNode]


class StatusNode(NodeEntry):
    target: str
    container: dict[str, Any] | None = None
    workdir: str | None = None
    release: str | None = None
    active_run: dict[str, Any] | None = None
    proxmox_node: str | None = None


class StatusAnswer(Envelope):
    command: Literal["status"]
    nodes: list[StatusNode]


class RunsNode(NodeEntry):
    target: str
    runs: list[dict[str, Any]] | None = Field(default=None, description="listing")
    removed: list[dict[str, Any]] | None = Field(default=None, description="--prune")
    dry_run: bool | None = Field(default=None, description="--prune")


class RunsAnswer(Envelope):
    command: Literal["runs"]
    nodes: list[RunsNode]


class RunsShowNode(NodeEntry):
    target: str
    runs: list[dict[str, Any]]


class RunsShowAnswer(Envelope):
    command: Literal["runs show"]
    nodes: list[RunsShowNode]


class Check(Open):
    name: str
    status: Literal["pass", "warn", "fail", "skip"]
    detail: str | None
    fix: str | None
    seconds: float


class DoctorNode(NodeEntry):
    checks: list[Check]


class DoctorAnswer(Envelope):
    command: Literal["doctor"]
    nodes: list[DoctorNode]
    ok: bool
    exit_code: int
    checks: list[Check] = Field(description="checks across the nodes")


class DeployNode(NodeEntry):
    target: str | None = None


class FollowNode(NodeEntry):
    pass


class FollowResult(Open):
    nodes: list[FollowNode]
    run: str
    status: str


class StartGate(Open):
    status: Literal["started", "died", "ended", "timeout", "interrupted"]
    seconds: float = Field(description="from the launch to the last node's start line")
    line: str = Field(description="the start line waited for (a regex)")
    timeout_s: float
    waiting_for: list[str] = Field(description="the nodes whose log had not shown it")


class DeployAnswer(Envelope):
    command: Literal["deploy", "restart"]
    nodes: list[DeployNode]
    run_id: str | None = None
    dry_run: bool | None = None
    result: FollowResult | None = Field(
        default=None, description="without --detach; with it, when the run died before starting"
    )
    start: StartGate | None = Field(
        default=None,
        description="with --detach, for a trainer that prints a start line (run.start_line)",
    )


class LogsAnswer(Envelope):
    command: Literal["logs"]
    nodes: list[FollowNode]
    run: str | None
    status: str


class PullFile(Open):
    path: str
    size: int
    sha256: str


class PullAnswer(Envelope):
    command: Literal["pull"]
    run_id: str
    to: str
    checkpoint: str | None
    export: str | None
    files: list[PullFile]


class StacksNode(NodeEntry):
    run_id: str
    status: str
    answers: list[dict[str, Any]] = Field(description="each rank's thread stacks")
    missing: list[int] = Field(description="the ranks that did not answer in time")


class StacksAnalysis(Open):
    ranks: list[dict[str, Any]] = Field(
        description="every rank of every node: node, last step, threads"
    )
    behind: list[int] = Field(description="the ranks behind the others")
    why: str
    collective: dict[str, Any] | None = Field(description="the collective they never issued")
    flight_recorder: dict[str, Any] | None = Field(
        description="every rank's dump, analysed together"
    )
    said: list[str]


class StacksAnswer(Envelope):
    command: Literal["stacks"]
    nodes: list[StacksNode]
    analysis: StacksAnalysis


ANSWERS: dict[str, type[Envelope]] = {
    "stop": StopAnswer,
    "status": StatusAnswer,
    "runs": RunsAnswer,
    "runs show": RunsShowAnswer,
    "doctor": DoctorAnswer,
    "deploy": DeployAnswer,
    "restart": DeployAnswer,
    "logs": LogsAnswer,
    "pull": PullAnswer,
    "stacks": StacksAnswer,
}
assert set(ANSWERS) == set(COMMANDS)


def schema_for(command: str) -> dict[str, Any]:
    adapter = TypeAdapter(Union[ANSWERS[command], ErrorAnswer])  # noqa: UP007 (a runtime union)
    schema = adapter.json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = f"dflashctl {command} --json (schema_version {SCHEMA_VERSION})"
    return schema


def schema_file(command: str) -> Path:
    return SCHEMA_DIR / f"{command.replace(' ', '-')}.json"


def rendered(command: str) -> str:
    return json.dumps(schema_for(command), indent=2, sort_keys=True) + "\n"


def write_all() -> list[Path]:
    SCHEMA_DIR.mkdir(exist_ok=True)
    written = []
    for command in COMMANDS:
        path = schema_file(command)
        path.write_text(rendered(command))
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write_all():
        sys.stdout.write(f"wrote {path}\n")
