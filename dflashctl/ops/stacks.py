"""`dflashctl stacks`: a live run's threads, per rank, as its trainer dumps them
(trainer/dflash/pipeline/stacks.py), with what its watchdog and the NCCL flight
recorder left (the agent's `stacks` verb, dflashctl/agent/stacks.py), every node asked
at once, and analysed together (analyse_together): every rank's flight recorder dump
of every node in one analysis (dumps named by host and rank that torch's own analyser
cannot join), which rank is behind, at which collective, and what its threads do.
Data only: commands/stacks.py shows it."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from dflashctl.ops import flight_recorder
from dflashctl.remote.agent_client import call_agent
from dflashctl.remote.nodes import NodeOutcome, node_sessions, on_every_node

_LIBRARY = re.compile(r"[/\\]lib[/\\]python\d[\d.]*[/\\]|[/\\](site|dist)-packages[/\\]|^<frozen ")
DUMP_FILES, DUMP_ERRORS = "_dump_files", "_dump_errors"  # never printed: see ask_stacks


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
    # The dumps' bytes, for the analysis across nodes (analyse_together takes them out).
    answer[DUMP_FILES], answer[DUMP_ERRORS] = decode_dumps(answer.get("flight_recorder") or [])
    for dump in answer.get("flight_recorder") or []:
        dump.pop("data", None)  # the pickles themselves stay in the run folder
    return answer


def summarise_dumps(dumps: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not dumps:
        return None
    files, errors = decode_dumps(dumps)
    summary = flight_recorder.summarise_files(files)
    summary.errors += errors
    return summary.to_json()


def decode_dumps(dumps: list[dict[str, Any]]) -> tuple[dict[int, bytes], list[str]]:
    """{rank: the dump's bytes} of the agent's answer, and what could not be had."""
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
    return files, errors


def stacks_of_every_node(
    config: Any, run_id: str | None, wait_s: float
) -> list[NodeOutcome[dict[str, Any]]]:
    """Each node's answer (ask_stacks), or the error that kept it from one."""
    with node_sessions(config) as nodes:
        return on_every_node(
            nodes, lambda node: ask_stacks(node.target, node.config, run_id, wait_s)
        )


def analyse_together(outcomes: list[NodeOutcome[dict[str, Any]]]) -> dict[str, Any]:
    """Every node's answer as one job: each rank (its node, last step, where its threads
    stand), the flight recorder's dumps of every rank analysed together, and the ranks
    behind: those that never issued the collective the others wait in, else those at
    the lowest step, else those that did not answer (stopped, or holding the GIL)."""
    files: dict[int, bytes] = {}
    errors: list[str] = []
    ranks: dict[int, dict[str, Any]] = {}
    for outcome in outcomes:
        answer = outcome.value
        if answer is None:
            continue
        node = outcome.node.name
        for rank, data in (answer.pop(DUMP_FILES, None) or {}).items():
            if rank in files:
                errors.append(f"rank {rank} left a dump on two nodes; node {node}'s is left out")
                continue
            files[rank] = data
        errors += answer.pop(DUMP_ERRORS, None) or []
        for how, dumps in (
            ("asked now", answer.get("answers")),
            ("watchdog", answer.get("watchdog")),
        ):
            for dump in dumps or []:
                rank = dump.get("rank")
                if isinstance(rank, int) and rank not in ranks:
                    ranks[rank] = _rank_view(dump, node, how)
        stopped = answer.get("stopped") or {}
        for rank in answer.get("missing") or []:
            view = ranks.setdefault(rank, {"rank": rank, "node": node, "threads": []})
            view.update(answered=False, stopped_pid=stopped.get(str(rank)))
    summary = flight_recorder.summarise_files(files) if files else None
    if summary is not None:
        summary.errors += errors
    missed = next((f for f in (summary.findings if summary else []) if f.kind == "missed"), None)
    behind, why = _behind(ranks, missed, summary)
    said = []
    for rank in behind:
        view = ranks.get(rank) or {"node": None, "threads": []}
        where = f" on node {view['node']}" if view.get("node") else ""
        doing = "; ".join(f"{t['name']} at {t['at']}" for t in view["threads"] if t["at"])
        said.append(f"rank {rank}{where} is behind ({why}){': ' + doing if doing else ''}")
    return {
        "ranks": [ranks[r] for r in sorted(ranks)],
        "behind": behind,
        "why": why,
        "collective": missed.to_json() if missed is not None else None,
        "flight_recorder": summary.to_json() if summary is not None else None,
        "said": said,
    }


def _rank_view(dump: dict[str, Any], node: str, how: str) -> dict[str, Any]:
    threads = []
    for thread in dump.get("threads") or []:
        frames = thread.get("frames") or []
        # Where the program's own code stands: the innermost frame outside Python's
        # library and the installed packages (threading.wait says little).
        own = [f for f in frames if not _LIBRARY.search(str(f.get("file")))]
        last = (own or frames)[-1] if frames else {}
        at = f"{last.get('file')}:{last.get('line')} in {last.get('function')}" if last else ""
        threads.append({"name": thread.get("name"), "at": at})
    return {
        "rank": dump.get("rank"),
        "node": node,
        "host": dump.get("host"),
        "pid": dump.get("pid"),
        "last_step": dump.get("last_step"),
        "answered": how == "asked now",
        "how": how,
        "threads": threads,
    }


def _behind(ranks: dict[int, dict[str, Any]], missed: Any, summary: Any) -> tuple[list[int], str]:
    if missed is not None:
        return sorted(missed.ranks), f"never issued collective #{missed.seq} ({missed.op})"
    if summary is not None and summary.absent:
        return sorted(summary.absent), "left no flight recorder dump"
    steps = {r: v["last_step"] for r, v in ranks.items() if v.get("last_step") is not None}
    if steps and len(set(steps.values())) > 1:
        low = min(steps.values())
        return sorted(r for r, s in steps.items() if s == low), f"at step {low}, the others further"
    silent = sorted(r for r, v in ranks.items() if v.get("answered") is False)
    if silent:
        return silent, "did not answer"
    return [], "no rank is behind the others"
