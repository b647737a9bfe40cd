"""What a node's workdir really holds after a fault, read from the host, and whether a
2-node deploy's outcome is all-or-nothing.

Everything is read through /proc/<container init>/root, the container's own view of
its files (its mounts included: a workdir on a tmpfs mounted inside the container is
seen as the container sees it). Which runs run comes from the process table (a live
process of the container whose environment says DFLASH_RUN_ID), never from a record
the deploy wrote; `current` is checked against its release's manifest file by file.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

WORKDIR = "/root/dflash"


def _ns(pid: int | str, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _alive(pid: str) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _env(pid: str) -> dict[bytes, bytes]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def workdir_view(container, workdir: str = WORKDIR) -> Path:
    """The host path that shows the container's workdir as the container sees it."""
    init = container.init_pid()
    if init is None:
        raise RuntimeError(f"container {container.vmid} is not running")
    return Path(f"/proc/{init}/root") / workdir.lstrip("/")


def running_runs(container) -> set[str]:
    """Run ids with a live process in the container (wrapper, torchrun or a rank)."""
    init = container.init_pid()
    namespace = _ns(init, "pid") if init else None
    found: set[str] = set()
    if namespace is None:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or _ns(entry, "pid") != namespace or not _alive(entry):
            continue
        run_id = _env(entry).get(b"DFLASH_RUN_ID")
        if run_id:
            found.add(run_id.decode())
    return found


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def release_complete(view: Path, release: str) -> tuple[bool, str]:
    """Is releases/<release> every file its manifest lists, byte for byte? (ok, why not)."""
    folder = view / "releases" / release
    try:
        manifest = json.loads((view / "releases" / f"{release}.manifest.json").read_text())
        files = manifest["manifest"]
    except (OSError, ValueError, KeyError) as exc:
        return False, f"no readable manifest for release {release}: {exc}"
    for rel, (size, sha, _mode) in files.items():
        path = folder / rel
        try:
            if path.stat().st_size != size or _sha256(path) != sha:
                return False, f"{rel} differs from the manifest"
        except OSError:
            return False, f"{rel} is missing"
    return True, ""


def lock_held(view: Path) -> bool:
    """Does a deploy, restart or stop (or the launch it left running) hold the workdir's
    lock? A shared lock taken for an instant: only ever asked once the CLI is gone."""
    try:
        fd = os.open(view / ".lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # closing drops the shared lock, if it was taken
    return False


@dataclass
class NodeState:
    name: str
    running: set[str]
    current: str | None
    complete: bool
    why_incomplete: str = ""
    partials: list[str] = field(default_factory=list)
    busy: bool = False

    def describe(self) -> str:
        runs = ", ".join(sorted(self.running)) or "nothing"
        cur = self.current or "none"
        bad = (
            "" if self.complete or self.current is None else f" (INCOMPLETE: {self.why_incomplete})"
        )
        return f"{self.name}: running {runs}; current {cur}{bad}"


def node_state(name: str, container, workdir: str = WORKDIR) -> NodeState:
    view = workdir_view(container, workdir)
    try:
        target = os.readlink(view / "current")
        current = os.path.basename(target.rstrip("/"))
    except OSError:
        current = None
    complete, why = release_complete(view, current) if current else (True, "")
    releases = view / "releases"
    partials = (
        sorted(p.name for p in releases.iterdir() if p.name.endswith(".partial"))
        if releases.is_dir()
        else []
    )
    return NodeState(
        name=name,
        running=running_runs(container),
        current=current,
        complete=complete,
        why_incomplete=why,
        partials=partials,
        busy=lock_held(view),
    )


def run_ids(container, workdir: str = WORKDIR) -> set[str]:
    runs = workdir_view(container, workdir) / "runs"
    return {p.name for p in runs.iterdir()} if runs.is_dir() else set()


def release_ids(container, workdir: str = WORKDIR) -> set[str]:
    releases = workdir_view(container, workdir) / "releases"
    if not releases.is_dir():
        return set()
    return {p.name for p in releases.iterdir() if p.is_dir() and not p.name.endswith(".partial")}


@dataclass
class Outcome:
    good: bool
    which: str  # "new", "old", "nothing" or "mix"
    detail: str


def classify(before: list[NodeState], after: list[NodeState]) -> Outcome:
    """GOOD: every node runs one new run (the same id), or every node still runs the
    run it ran before (nothing where nothing ran); `current` is one complete release
    on every node."""
    said = "; ".join(s.describe() for s in after)
    olds = [s.running for s in before]
    nows = [s.running for s in after]
    if (
        all(now == old for now, old in zip(nows, olds, strict=True))
        and len({frozenset(o) for o in olds}) == 1
    ):
        which = "old" if olds[0] else "nothing"
    elif (
        all(len(now) == 1 for now in nows)
        and len({frozenset(n) for n in nows}) == 1
        and not (nows[0] & olds[0])
    ):
        which = "new"
    else:
        return Outcome(False, "mix", f"runs differ between nodes: {said}")
    currents = {s.current for s in after}
    if len(currents) != 1:
        return Outcome(False, which, f"`current` differs between nodes: {said}")
    incomplete = [s for s in after if not s.complete]
    if incomplete:
        return Outcome(False, which, f"`current` incomplete: {said}")
    if which == "old" and {s.current for s in before} != currents:
        return Outcome(False, which, f"the old run runs, but `current` moved: {said}")
    return Outcome(True, which, said)
