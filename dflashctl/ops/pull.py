"""`dflashctl pull RUN`: a run's checkpoint (the latest, or --step N), its serving
export (the checkpoint's drafter/ folder) and its metrics, copied to a local folder.

The agent's `pull_plan` lists the files with their sizes and modes where the run
wrote them (links are named, never followed), and leaves that list in a file there.
One reader (`_READER`, one `pct exec` on one SSH channel) then sends every file still
wanted as one stream of frames, each file from its offset and up to the size listed,
followed by the sha256 it took of the file as it read it (so each file is read once
there). Each goes into `<dest>.partial`, which is renamed into place (with its mode)
once its sha256 matches; a file already here at its size is only hashed there. A
pull that was cut leaves the .partial files: the next one continues each from its
size and checks the whole file at the end (a mismatch is fetched again from the
start, once). Several nodes: the checkpoint and the metrics come from the node that
wrote them: rank 0's, the first node, else the first node that has them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from dflashctl import hints
from dflashctl.errors import HostError, UsageError
from dflashctl.remote import agent_client
from dflashctl.remote.nodes import (
    Node,
    fleet_failure,
    names_each_node,
    nobody_answered,
    on_every_node,
)
from dflashctl.reporting import SILENT, Reporter

# Sends the files the pull wants, from the list the plan left (argv[1]: [[path, size],
# ...]), as frames: `D <index> <n>\n` and n bytes; then `H <index> <bytes read>
# <sha256>\n`, the digest of the file's first `size` bytes (all of them, from 0, also
# those of a file continued from an offset), taken as it is read: each file is read
# once; `X <index> <why>\n` for a file that could not be read. argv[2]: `i` or `i-j`
# (from 0), `i@offset`, or `i#` (its digest only), comma separated. Python 3.6+, stdlib
# only; a link is never followed.
_READER = """
import hashlib, json, os, sys
files = json.load(open(sys.argv[1]))
out = sys.stdout.buffer
def send(i, offset, data=True):
    path, size = files[i]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        out.write(b"X %d %s\\n" % (i, str(exc.strerror or exc).encode()))
        return
    digest = hashlib.sha256()
    at = 0
    try:
        while at < size:
            b = os.read(fd, min(1 << 20, size - at))
            if not b:
                break
            digest.update(b)
            n = len(b)
            if data and at + n > offset:
                if offset > at:
                    b = b[offset - at:]
                out.write(b"D %d %d\\n" % (i, len(b)))
                out.write(b)
            at += n
    finally:
        os.close(fd)
    out.write(b"H %d %d %s\\n" % (i, at, digest.hexdigest().encode()))
for part in sys.argv[2].split(","):
    if "@" in part:
        i, offset = part.split("@")
        send(int(i), int(offset))
    elif part.endswith("#"):
        send(int(part[:-1]), 0, False)
    else:
        first, _, last = part.partition("-")
        for i in range(int(first), int(last or first) + 1):
            send(i, 0)
out.flush()
"""
SPEC_CHARS = 60_000  # one stream's wanted list on its command line; more: another stream
PARTIAL = ".partial"


@dataclass
class PullFile:
    rel: str
    path: str
    size: int
    node: Node
    index: int  # in the node's list (`listing`)
    listing: str  # the list the node's plan left
    mode: int = 0o644
    sha256: str = ""  # as the reader took it where the run wrote it, once it said it


def plans(
    nodes: list[Node], run_id: str, step: int | None, report: Reporter = SILENT
) -> list[dict[str, Any]]:
    def ask(node: Node) -> dict[str, Any]:
        params = {"workdir": node.config.container.workdir, "run_id": run_id, "step": step}
        return agent_client.call_agent(
            node.target, node.config.container.python, "pull_plan", params, timeout=3600
        )

    outcomes = on_every_node(nodes, ask)
    if nobody_answered(outcomes):
        raise cast(BaseException, fleet_failure(outcomes, "looking for the run"))
    for o in outcomes:
        if o.ok:
            continue
        report.warning(f"{o.node.describe()}: {o.error}")
    return [o.value if o.ok else {"found": False, "runs": []} for o in outcomes]  # type: ignore[misc]


def choose(nodes: list[Node], answers: list[dict[str, Any]], run_id: str, step: int | None):
    """The files to pull and where from; a UsageError for an unknown run or step."""
    found = [(n, a) for n, a in zip(nodes, answers, strict=True) if a.get("found")]
    if not found:
        known = sorted({r for a in answers for r in a.get("runs") or []})
        listed = ", ".join(known[-5:]) if known else "none yet"
        raise UsageError(
            f"no run {run_id} on {'any node' if names_each_node(nodes) else nodes[0].describe()} "
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
        checkpoint = with_ckpt[0][1]["checkpoint"]
        prefix = f"checkpoints{os.sep}"
        files += _files(*with_ckpt[0], lambda rel: rel.startswith(prefix))

    def metrics(rel: str) -> bool:  # everything of the run that is not a checkpoint
        return not rel.startswith("checkpoints")

    with_metrics = [(n, a) for n, a in found if any(metrics(f["rel"]) for f in a["files"])]
    if with_metrics:
        files += _files(*with_metrics[0], metrics)
    return files, checkpoint


def _files(node: Node, answer: dict[str, Any], wanted: Callable[[str], bool]) -> list[PullFile]:
    """The files of `answer`'s list whose path is `wanted`."""
    return [
        PullFile(
            f["rel"], f["path"], int(f["size"]), node, i, answer["list"], int(f.get("mode", 0o644))
        )
        for i, f in enumerate(answer["files"])
        if wanted(f["rel"])
    ]


def links_left_out(answers: list[dict[str, Any]]) -> list[str]:
    """`rel -> target` of every link the plans named (pull copies files, never links)."""
    return sorted(
        {f"{link['rel']} -> {link['target']}" for a in answers for link in a.get("links") or []}
    )


def local_sha256(path: str) -> str:
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
    finally:
        os.close(fd)
    return digest.hexdigest()


class _Arrival:
    """A file's .partial as it fills: its sha256 so far and its size (the bytes
    already there, for a file continued, are read once for the hash). Opened on its
    first bytes with os.open (Python's open() adds three system calls a file), only
    this user may read it until it is complete."""

    def __init__(self, partial: str, offset: int) -> None:
        self.partial = partial
        self.size = offset
        self.digest = hashlib.sha256()
        self.fd: int | None = None
        if offset:
            with open(partial, "rb") as f:
                while chunk := f.read(1 << 20):
                    self.digest.update(chunk)

    def write(self, data) -> None:  # noqa: ANN001  (bytes or a memoryview)
        if self.fd is None:
            more = os.O_APPEND if self.size else os.O_TRUNC
            self.fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | more, 0o600)
        self.digest.update(data)
        self.size += len(data)
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def finish(self, mode: int) -> None:
        """Closed with its mode (an empty file, which gets no frame, is made here)."""
        if self.fd is None:
            self.write(b"")
        os.fchmod(self.fd, mode)  # type: ignore[arg-type]
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def pull_files(files: list[PullFile], dest: Path, report: Reporter = SILENT) -> dict[str, int]:
    """Fetch what is missing; returns counts: fetched, resumed, already, bytes. A file
    here of the listed size is only hashed there (`i#`) and fetched when it differs;
    each file fetched goes into its .partial and is renamed into place once its sha256
    is the one the reader took (a mismatch is fetched again from 0, once)."""
    counts = {"fetched": 0, "resumed": 0, "already": 0, "bytes": 0}
    top = str(dest.resolve())
    finals = {f.rel: _local(top, f.rel) for f in files}
    here: dict[str, str] = {}  # rel -> the sha256 of the file of its size already here
    offsets: dict[str, int] = {}
    folders: dict[str, bool] = {}  # folder -> there already (a new one holds nothing)
    for f in files:
        final = finals[f.rel]
        folder = os.path.dirname(final)
        if folder not in folders:
            folders[folder] = os.path.isdir(folder)
        if not folders[folder]:
            offsets[f.rel] = 0
        elif _size(final) == f.size:
            here[f.rel] = local_sha256(final)
        else:
            partial = _size(final + PARTIAL) or 0  # (longer than the file: not its start)
            offsets[f.rel] = partial if partial <= f.size else 0
    resumed = {rel for rel, offset in offsets.items() if offset}
    made: set[str] = set()
    todo = files
    with report.transfer(
        sum(f.size - offsets[f.rel] for f in files if f.rel in offsets),
        f"pulling {len(offsets)} files",
        "checking sha256",
    ) as progress:
        for _attempt in (1, 2):
            for f in todo:
                folder = os.path.dirname(finals[f.rel])
                if f.rel in offsets and folder not in made:
                    os.makedirs(folder, exist_ok=True)
                    made.add(folder)
            arrivals = {
                f.rel: _Arrival(finals[f.rel] + PARTIAL, offsets[f.rel])
                for f in todo
                if f.rel in offsets
            }

            def arrived(f: PullFile, read: int, sha: str, arrivals=arrivals) -> bool:
                """The reader's digest of `f` came: True when what is here matches."""
                f.sha256 = sha
                if f.rel in here:
                    if here[f.rel] == sha and read == f.size:
                        os.chmod(finals[f.rel], f.mode)
                        counts["already"] += 1
                        return True
                    return False
                arrival = arrivals[f.rel]
                if arrival.size == f.size == read and arrival.digest.hexdigest() == sha:
                    arrival.finish(f.mode)
                    os.replace(arrival.partial, finals[f.rel])
                    counts["resumed" if f.rel in resumed else "fetched"] += 1
                    return True
                arrival.close()
                os.unlink(arrival.partial)  # a continued prefix that was not the source's
                return False

            try:
                moved, done = _stream(todo, arrivals, offsets, arrived, progress)
            finally:
                for arrival in arrivals.values():
                    arrival.close()
            counts["bytes"] += moved
            todo = [f for f in todo if f.rel not in done]
            for f in todo:  # fetched again, whole: counted as fetched, not resumed
                here.pop(f.rel, None)
                offsets[f.rel] = 0
                resumed.discard(f.rel)
            if not todo:
                break
    if todo:
        f = todo[0]
        raise HostError(
            f"{f.rel} arrived with a different sha256 than {f.path} on {f.node.describe()}",
            hint="the file may have changed there meanwhile; pull again",
        )
    return counts


def _local(top: str, rel: str) -> str:
    """Where `rel` goes under the pull folder `top`; never outside it."""
    norm = os.path.normpath(rel)
    if os.path.isabs(norm) or norm == "." or norm.split(os.sep)[0] == "..":
        raise HostError(f"the run lists a file outside the pull folder: {rel!r}")
    return os.path.join(top, norm)


def _size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def wanted_specs(items: list[tuple[int, int | None]]) -> list[str]:
    """(index, offset) pairs, sorted, as the reader's wanted lists: runs of whole files
    as `i-j`, a resumed file as `i@offset`, a file only to hash (offset None) as `i#`;
    several lists when one would not fit a command line."""
    parts: list[str] = []
    run: list[int] = []

    def close_run() -> None:
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run.clear()

    for index, offset in items:
        if offset is None or offset:
            close_run()
            parts.append(f"{index}#" if offset is None else f"{index}@{offset}")
        elif run and index == run[-1] + 1:
            run.append(index)
        else:
            close_run()
            run.append(index)
    close_run()
    specs, current = [], ""
    for part in parts:
        if current and len(current) + len(part) + 1 > SPEC_CHARS:
            specs.append(current)
            current = ""
        current = f"{current},{part}" if current else part
    return specs + ([current] if current else [])


def _stream(todo, arrivals, offsets, arrived, progress) -> tuple[int, set[str]]:
    """Every file of `todo` from its offset into its .partial (or only its digest, for
    one not in `offsets`): one reader stream per node and list (more only for a
    wanted list too long for one command line). Returns the bytes moved and the files
    `arrived(f, read, sha)` took."""
    moved = 0
    done: set[str] = set()
    groups: dict[tuple[str, str], list[PullFile]] = {}
    for f in todo:
        groups.setdefault((f.node.name, f.listing), []).append(f)
    for group in groups.values():
        by_index = {f.index: f for f in group}
        items = sorted((f.index, offsets.get(f.rel)) for f in group)
        for spec in wanted_specs(items):
            moved += _read_stream(group[0], spec, by_index, arrivals, arrived, done, progress)
    return moved, done


def _read_stream(first: PullFile, spec: str, by_index, arrivals, arrived, done, progress) -> int:
    node = first.node
    argv = [node.config.container.python, "-S", "-c", _READER, first.listing, spec]
    moved, buffer, current = 0, b"", None
    need = 0  # bytes of the current frame's data still to come
    problems = []
    with node.target.stream(argv) as stream:
        while True:
            data = stream.read(5.0)
            if data is None:
                continue
            if data == b"":
                break
            buffer = buffer + data if buffer else data
            pos = 0
            while pos < len(buffer):
                if need:
                    take = memoryview(buffer)[pos : pos + need]
                    pos += len(take)
                    current.write(take)  # type: ignore[union-attr]
                    need -= len(take)
                    moved += len(take)
                    progress(len(take))
                    continue
                end = buffer.find(b"\n", pos)
                if end < 0:
                    break
                kind, index, rest = buffer[pos:end].decode("utf-8", "replace").split(" ", 2)
                pos = end + 1
                f = by_index[int(index)]
                if kind == "D":
                    current, need = arrivals[f.rel], int(rest)
                elif kind == "H":
                    read, sha = rest.split(" ")
                    if arrived(f, int(read), sha):
                        done.add(f.rel)
                else:
                    problems.append(f"{f.path}: {rest}")
            buffer = buffer[pos:]
        status = stream.exit_status
    if status:
        detail = stream.stderr.decode("utf-8", "replace").strip().splitlines()
        raise HostError(
            f"reading the run's files on {node.describe()} failed (exit status {status})"
            + (f": {detail[-1]}" if detail else ""),
            hint="pull again: it continues from what arrived",
        )
    if problems:
        raise HostError(
            f"cannot read {problems[0]} on {node.describe()}"
            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
            hint="pull again: it continues from what arrived",
        )
    return moved
