"""`dflashctl pull RUN`: a run's checkpoint (the latest, or --step N), its serving
export (the checkpoint's drafter/ folder) and its metrics, copied to a local folder.

The agent's `pull_plan` lists the files with their sizes and sha256 where the run
wrote them; each file is then streamed (`pct exec` of a small reader, from an offset
and for the size listed) into `<dest>.partial`, which is renamed into place once its
sha256 matches. A pull that was cut leaves the .partial files: the next one continues
each from its size and checks the whole file at the end (a mismatch is fetched again
from the start, once). Several nodes: the checkpoint and the metrics come from the
node that wrote them: rank 0's, the first node, else the first node that has them.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashctl import agent_client, hints
from dflashctl.errors import HostError, UsageError
from dflashctl.nodes import Node, on_every_node
from dflashctl.reporting import SILENT, Reporter

# Reads `length` bytes of a file from `offset` to stdout (Python 3.6+, stdlib only).
_READER = (
    "import sys\n"
    "f = open(sys.argv[1], 'rb'); f.seek(int(sys.argv[2])); left = int(sys.argv[3])\n"
    "out = sys.stdout.buffer\n"
    "while left > 0:\n"
    "    b = f.read(min(1 << 20, left))\n"
    "    if not b: break\n"
    "    out.write(b); left -= len(b)\n"
    "out.flush()\n"
)
PARTIAL = ".partial"


@dataclass
class PullFile:
    rel: str
    path: str
    size: int
    sha256: str
    node: Node


def plans(
    nodes: list[Node], run_id: str, step: int | None, report: Reporter = SILENT
) -> list[dict[str, Any]]:
    def ask(node: Node) -> dict[str, Any]:
        params = {"workdir": node.config.container.workdir, "run_id": run_id, "step": step}
        return agent_client.call_agent(
            node.target, node.config.container.python, "pull_plan", params, timeout=3600
        )

    outcomes = on_every_node(nodes, ask)
    failed = [o for o in outcomes if not o.ok]
    if failed and len(failed) == len(outcomes):
        raise failed[0].error  # type: ignore[misc]
    for o in failed:
        report.warning(f"{o.node.describe()}: {o.error}")
    return [o.value if o.ok else {"found": False, "runs": []} for o in outcomes]  # type: ignore[misc]


def choose(nodes: list[Node], answers: list[dict[str, Any]], run_id: str, step: int | None):
    """The files to pull and where from; a UsageError for an unknown run or step."""
    found = [(n, a) for n, a in zip(nodes, answers, strict=True) if a.get("found")]
    if not found:
        known = sorted({r for a in answers for r in a.get("runs") or []})
        listed = ", ".join(known[-5:]) if known else "none yet"
        raise UsageError(
            f"no run {run_id} on {nodes[0].describe() if len(nodes) == 1 else 'any node'} "
            f"(latest runs: {listed})",
            hint=f"{hints.command('runs')} lists the runs",
        )
    with_ckpt = [(n, a) for n, a in found if a.get("checkpoint")]
    if step is not None and not with_ckpt:
        steps = sorted({s for _, a in found for s in a.get("steps") or []})
        there = ", ".join(str(s) for s in steps) if steps else "none"
        raise UsageError(
            f"run {run_id} has no checkpoint at step {step} (its checkpoints: {there})",
            hint="pass one of those to --step, or leave --step out for the latest",
        )
    files: list[PullFile] = []
    checkpoint = None
    if with_ckpt:
        node, answer = with_ckpt[0]
        checkpoint = answer["checkpoint"]
        prefix = f"checkpoints{os.sep}"
        files += [_file(f, node) for f in answer["files"] if f["rel"].startswith(prefix)]
    with_metrics = [
        (n, a) for n, a in found if any(not f["rel"].startswith("checkpoints") for f in a["files"])
    ]
    if with_metrics:
        node, answer = with_metrics[0]
        files += [_file(f, node) for f in answer["files"] if not f["rel"].startswith("checkpoints")]
    return files, checkpoint


def _file(entry: dict[str, Any], node: Node) -> PullFile:
    return PullFile(entry["rel"], entry["path"], int(entry["size"]), entry["sha256"], node)


def local_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pull_files(files: list[PullFile], dest: Path, report: Reporter = SILENT) -> dict[str, int]:
    """Fetch what is missing; returns counts: fetched, resumed, already, bytes."""
    counts = {"fetched": 0, "resumed": 0, "already": 0, "bytes": 0}
    todo = []
    for f in files:
        final = _local(dest, f.rel)
        if final.is_file() and final.stat().st_size == f.size and local_sha256(final) == f.sha256:
            counts["already"] += 1
        else:
            todo.append(f)
    total = sum(f.size - _partial_size(dest, f) for f in todo)
    with report.transfer(total, f"pulling {len(todo)} files", "checking sha256") as progress:
        for f in todo:
            resumed = _partial_size(dest, f) > 0
            counts["bytes"] += _fetch(f, dest, progress)
            counts["resumed" if resumed else "fetched"] += 1
    return counts


def _local(dest: Path, rel: str) -> Path:
    path = (dest / rel).resolve()
    if dest.resolve() not in path.parents:
        raise HostError(f"the run lists a file outside the pull folder: {rel!r}")
    return path


def _partial_size(dest: Path, f: PullFile) -> int:
    partial = _local(dest, f.rel + PARTIAL)
    size = partial.stat().st_size if partial.is_file() else 0
    return size if size <= f.size else 0


def _fetch(f: PullFile, dest: Path, progress) -> int:
    """One file into place, continuing its .partial; returns the bytes moved."""
    final = _local(dest, f.rel)
    partial = _local(dest, f.rel + PARTIAL)
    final.parent.mkdir(parents=True, exist_ok=True)
    moved = 0
    for attempt in (1, 2):
        offset = _partial_size(dest, f)
        if offset == 0 and partial.exists():
            partial.unlink()  # longer than the source: not a prefix of it
        moved += _stream_into(f, partial, offset, progress)
        if partial.stat().st_size == f.size and local_sha256(partial) == f.sha256:
            os.replace(partial, final)
            return moved
        partial.unlink()  # a resumed prefix that was not the source's: from the start
        if attempt == 2:
            raise HostError(
                f"{f.rel} arrived with a different sha256 than {f.path} on {f.node.describe()}",
                hint="the file may have changed there meanwhile; pull again",
            )
    return moved


def _stream_into(f: PullFile, partial: Path, offset: int, progress) -> int:
    python = f.node.config.container.python
    argv = [python, "-S", "-c", _READER, f.path, str(offset), str(f.size - offset)]
    moved = 0
    with partial.open("ab") as out, f.node.target.stream(argv) as stream:
        while True:
            data = stream.read(5.0)
            if data is None:
                continue
            if data == b"":
                break
            out.write(data)
            moved += len(data)
            progress(len(data))
        status = stream.exit_status
    if status:
        detail = stream.stderr.decode("utf-8", "replace").strip().splitlines()
        raise HostError(
            f"reading {f.path} on {f.node.describe()} failed (exit status {status})"
            + (f": {detail[-1]}" if detail else ""),
            hint="pull again: it continues from what arrived",
        )
    return moved
