"""`dflashctl stacks`: a live run's threads, per rank, as its trainer dumps them
(trainer/dflash/pipeline/stacks.py), with what its watchdog and the NCCL flight
recorder left (the agent's `stacks` verb, dflashctl/agent/stacks.py), every node asked
at once. Data only: commands/stacks.py shows it."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from dflashctl import flight_recorder
from dflashctl.agent_client import call_agent
from dflashctl.nodes import NodeOutcome, node_sessions, on_every_node

# The trainer polls for a request every 0.2 s; a rank busy in a long C call (a whole
# step on the CPU) answers once its GIL is free again.
DEFAULT_WAIT_S = 10.0


def ask_stacks(target: Any, config: Any, run_id: str | None, wait_s: float) -> dict[str, Any]:
    """One node's answer, with its flight recorder dumps summarised."""
    answer = call_agent(
        target,
        config.container.python,
        "stacks",
        {"workdir": config.container.workdir, "run_id": run_id, "wait_s": wait_s},
        timeout=wait_s + 60,
    )
    answer["where"] = target.describe()
    answer["flight_recorder_summary"] = summarise_dumps(answer.get("flight_recorder") or [])
    for dump in answer.get("flight_recorder") or []:
        dump.pop("data", None)  # the pickles themselves stay in the run folder
    return answer


def summarise_dumps(dumps: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not dumps:
        return None
    files, errors = {}, []
    for dump in dumps:
        if dump.get("too_big"):
            errors.append(
                f"rank {dump['rank']}'s dump ({dump['bytes']} bytes) is too big to read here"
            )
            continue
        try:
            files[int(dump["rank"])] = base64.b64decode(dump.get("data") or "")
        except (binascii.Error, ValueError):
            errors.append(f"rank {dump['rank']}'s dump came garbled")
    summary = flight_recorder.summarise_files(files)
    summary.errors += errors
    return summary.to_json()


def stacks_of_every_node(
    config: Any, run_id: str | None, wait_s: float
) -> list[NodeOutcome[dict[str, Any]]]:
    """Each node's answer (ask_stacks), or the error that kept it from one."""
    with node_sessions(config) as nodes:
        return on_every_node(
            nodes, lambda node: ask_stacks(node.target, node.config, run_id, wait_s)
        )
