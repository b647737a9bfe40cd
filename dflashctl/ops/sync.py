"""What to send: the manifest of the local trainer tree, and what `trainer.exclude` left out.

The manifest maps each file's path (relative, with "/") to [size, sha256, mode]
(the file's permissions in octal, "644", "755", "600": a `chmod` alone is a change
that deploys), and each link's to ["link", target] (agent/manifest.py), after
`trainer.exclude`, which has .gitignore semantics (the
pathspec library's GitIgnoreSpec): `*` and `?` stay inside one path segment, `**`
spans segments, a trailing `/` matches folders only, a pattern with a `/` before its
end is anchored at the tree's top, `!` re-includes what an earlier pattern excluded
(not inside an excluded folder, as in git), `#` starts a comment.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pathspec

# One definition of file modes, shared with the agent that checks releases where the
# trainer runs.
from dflashctl.agent.manifest import file_mode, is_link, link_entry, link_stays_inside
from dflashctl.errors import UsageError
from dflashctl.ops.source_cache import SourceCache

# The archive's first member: the manifest of the whole new release. The agent takes
# the first member as such whatever its name, so a trainer file of any name (this one,
# or a MANIFEST.json of its own) is just a file.
METADATA_MEMBER = ".dflashctl/manifest.json"
Manifest = dict[str, list]  # path -> [size, sha256, mode], or ["link", target]


def sent_size(entry: list) -> int:
    """The bytes a manifest entry sends when it changed: a link's are in the manifest."""
    return 0 if is_link(entry) else int(entry[0])


# --------------------------------------------------------------------------- excludes


class Excludes:
    """gitignore-style matcher for paths relative to the trainer source."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = list(patterns)
        try:
            self._spec = pathspec.GitIgnoreSpec.from_lines(self.patterns)
        except (ValueError, TypeError) as exc:
            raise UsageError(
                f"trainer.exclude: {exc}", hint="fix the pattern (gitignore syntax)"
            ) from None

    def excluded(self, rel_path: str, is_dir: bool) -> bool:
        # GitIgnoreSpec tells a folder from a file by a trailing "/".
        return self._spec.match_file(rel_path + "/" if is_dir else rel_path)


# Left out without a word: every tree has them, and nobody means to deploy them.
_UNREMARKABLE = ("__pycache__", ".git", ".mypy_cache", ".pytest_cache", ".ruff_cache")


@dataclass
class Skipped:
    """What `trainer.exclude` left out: folders (not entered, so not counted) and files."""

    folders: list[str] = field(default_factory=list)
    files: list[tuple[str, int]] = field(default_factory=list)  # (path, size)

    def add(self, rel: str, is_dir: bool, size: int) -> None:
        name = rel.rsplit("/", 1)[-1]
        if name in _UNREMARKABLE or name.endswith((".pyc", ".pyo")):
            return
        if is_dir:
            self.folders.append(rel + "/")
        else:
            self.files.append((rel, size))

    def names(self) -> list[str]:
        return self.folders + [rel for rel, _ in self.files]

    def describe(self, human_bytes, limit: int = 6) -> str | None:
        """One line: folders first, then the largest files with their sizes."""
        items = self.folders + [
            f"{rel} ({human_bytes(size)})"
            for rel, size in sorted(self.files, key=lambda item: (-item[1], item[0]))
        ]
        if not items:
            return None
        shown = ", ".join(items[:limit])
        more = f" and {len(items) - limit} more" if len(items) > limit else ""
        return f"left out by trainer.exclude: {shown}{more}"


# --------------------------------------------------------------------------- manifest


def iter_files(
    source: Path, excludes: Excludes, skipped: Skipped | None = None
) -> Iterator[tuple[str, str | None]]:
    """(relative path, None) of each file to deploy and (relative path, its text) of
    each link; excluded folders are not entered (and noted in `skipped`, with the
    excluded files).

    A symlink whose target stays inside the source is deployed as a link (as `rsync
    -l`, git and docker keep one), to a file or a folder alike, and is not descended
    into: what it points at is deployed once, at its own place. Its text travels as
    it is when it is relative and, read as written, stays inside; else (an absolute
    path, or one that leaves and comes back) as the relative path from its folder to
    where it really leads. A link that leads out of the source (not excluded) is
    refused, naming every one: deploying what it points at would send files nobody
    chose to send (a key, a secret), and the link alone would lead somewhere else in
    the container. A dangling link that leads out sends nothing, as before.
    """
    top = os.path.realpath(source)
    leaving: list[str] = []
    found = list(_walk(Path(source), "", excludes, skipped or Skipped(), (top, leaving)))
    if leaving:
        shown = "; ".join(leaving[:8]) + (
            f"; and {len(leaving) - 8} more" if len(leaving) > 8 else ""
        )
        raise UsageError(
            f"trainer.source {source} has links that lead out of it: {shown}",
            hint="copy what they point at into the source, or leave them out with trainer.exclude",
        )
    yield from found


def _walk(
    folder: Path,
    prefix: str,
    excludes: Excludes,
    skipped: Skipped,
    outside: tuple[str, list[str]],
) -> Iterator[tuple[str, str | None]]:
    """`outside`: the source's real path, and the list its leaving links are added to.
    Only real folders are entered, so no folder is walked twice and no loop is met."""
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError as exc:
        raise unreadable(folder, exc) from None
    top, leaving = outside
    for entry in entries:
        rel = prefix + entry.name
        if entry.is_symlink():
            if excludes.excluded(rel, entry.is_dir()):
                skipped.add(rel, entry.is_dir(), 0)
                continue
            text = _link_text(entry.path, rel, top)
            if text is not None:
                yield rel, text
            elif os.path.exists(entry.path):  # (a dangling one that leads out sends nothing)
                leaving.append(f"{rel} -> {os.readlink(entry.path)}")
        elif entry.is_dir():
            if excludes.excluded(rel, True):
                skipped.add(rel, True, 0)
            else:
                yield from _walk(Path(entry.path), rel + "/", excludes, skipped, outside)
        elif entry.is_file():  # (sockets and fifos are neither)
            if excludes.excluded(rel, False):
                skipped.add(rel, False, _size(entry))
            else:
                yield rel, None


def _link_text(path: str, rel: str, top: str) -> str | None:
    """The text the link at `path` (`rel` in the source whose real path is `top`) is
    deployed with, or None when it leads out of the source."""
    try:
        text = os.readlink(path)
    except OSError as exc:
        raise unreadable(Path(path), exc) from None
    real = os.path.realpath(path)
    if real != top and not real.startswith(top.rstrip(os.sep) + os.sep):
        return None
    if link_stays_inside(rel, text):
        return text
    # Absolute, or out and back in by name: the same place, said from the link's folder
    # (a real folder of the source: links are never walked through).
    return os.path.relpath(real, os.path.realpath(os.path.dirname(path)))


def _size(entry: os.DirEntry) -> int:
    try:
        return entry.stat().st_size
    except OSError:
        return 0


def unreadable(path: Path, exc: OSError) -> UsageError:
    """A file or folder of the source that cannot be read: exit 2, before any host is
    contacted."""
    return UsageError(
        f"cannot read {path}: {exc.strerror or exc}",
        hint="make it readable (chmod u+r), or leave it out with trainer.exclude",
    )


# A .py file up to this size is kept in memory once read for its hash, so that the
# syntax check does not read it again (thousands of small files: half the reads).
KEEP_TEXT_BYTES = 1 << 20


def _hash_keeping_text(
    path: str, size: int, keep: bool
) -> tuple[str, bytes | None, os.stat_result]:
    """The file's sha256, its bytes when `keep` and they fit in KEEP_TEXT_BYTES, and
    its stat once read; `size`: what its stat said before. A small file costs four
    system calls (open, read, fstat, close): once the bytes read are as many as the
    file holds, there is no more to read. (The first read asks for `size` bytes, not
    a megabyte: os.read allocates what it is asked for, a megabyte is an mmap.)"""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunk = os.read(fd, min(size, KEEP_TEXT_BYTES) or 1)
        digest = hashlib.sha256(chunk)
        after = os.fstat(fd)
        if len(chunk) == after.st_size:
            return digest.hexdigest(), chunk if keep else None, after
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
        return digest.hexdigest(), None, os.fstat(fd)
    finally:
        os.close(fd)


def scan(
    source: Path,
    exclude: Iterable[str],
    cache: SourceCache | None = None,
    texts: dict[str, bytes] | None = None,
) -> tuple[Manifest, Skipped]:
    """The manifest of the tree and what trainer.exclude left out of it. With a cache,
    a file whose size, mtime and inode are as remembered is not read again. `texts`, if
    given, receives the bytes of the .py files read here (for check_syntax)."""
    source = Path(source)
    if not source.is_dir():
        raise UsageError(
            f"trainer.source {source} is not a folder",
            hint="point trainer.source in dflash.yaml at the trainer's folder",
        )
    excludes = Excludes(exclude)
    skipped = Skipped()
    manifest: Manifest = {}
    top = str(source)
    for rel, link in iter_files(source, excludes, skipped):
        if link is not None:
            manifest[rel] = link_entry(link)
            continue
        path = os.path.join(top, rel)  # (strings: pathlib costs more than the read here)
        try:
            stat = os.stat(path)
            sha = cache.sha256(rel, stat) if cache else None
            if sha is None:
                keep = texts is not None and rel.endswith(".py")
                sha, text, after = _hash_keeping_text(path, stat.st_size, keep)
                if text is not None:
                    texts[rel] = text  # type: ignore[index]
                if cache:
                    cache.remember(rel, stat, sha, after=after)
            manifest[rel] = [stat.st_size, sha, file_mode(stat.st_mode)]
        except OSError as exc:
            raise unreadable(Path(path), exc) from None
    return manifest, skipped


def build_manifest(source: Path, exclude: Iterable[str]) -> Manifest:
    return scan(source, exclude)[0]


@dataclass
class Diff:
    changed: list[str]  # new or different: these travel
    removed: list[str]  # in the current release, no longer in the source
    unchanged: list[str]

    @property
    def empty(self) -> bool:
        return not self.changed and not self.removed


def diff_manifests(local: Manifest, remote: Manifest | None) -> Diff:
    remote = remote or {}
    changed = sorted(p for p, entry in local.items() if list(remote.get(p) or []) != list(entry))
    removed = sorted(p for p in remote if p not in local)
    sent = set(changed)  # (a list here made this quadratic: 0.1 s at 5,000 files)
    unchanged = sorted(p for p in local if p not in sent)
    return Diff(changed, removed, unchanged)


# --------------------------------------------------------------------------- preflight


def check_syntax(
    source: Path,
    manifest: Manifest,
    cache: SourceCache | None = None,
    texts: dict[str, bytes] | None = None,
) -> int:
    """Compile every .py file (but those whose content the cache knows compiles);
    syntax errors become one UsageError naming each file:line with the offending line
    and a caret (all of them: one deploy, not one per broken file, to find them).
    `texts`: the bytes scan() read of some files, whose hash is then the manifest's.
    Returns how many were checked."""
    checked = 0
    problems: list[str] = []
    top = str(Path(source))
    for rel in sorted(manifest):
        if not rel.endswith(".py") or is_link(manifest[rel]):
            continue  # (a link's target is checked at its own place)
        sha = manifest[rel][1]
        if cache and cache.compiles(sha):
            checked += 1
            continue
        path = os.path.join(top, rel)
        text = texts.get(rel) if texts else None
        known = text is not None  # read when it was hashed: its hash is `sha`
        if text is None:
            try:
                with open(path, "rb") as f:
                    text = f.read()
            except OSError as exc:
                raise unreadable(Path(path), exc) from None
        try:
            compile(text, path, "exec", dont_inherit=True)
        except SyntaxError as exc:
            problems.append(_syntax_message(Path(path), exc))
        except ValueError as exc:  # e.g. null bytes in the source
            problems.append(f"{path}: cannot compile: {exc}")
        else:
            if cache and (known or hashlib.sha256(text).hexdigest() == sha):
                cache.compiled(sha)
        checked += 1
    if len(problems) == 1:
        raise UsageError(problems[0], hint="fix it, then deploy again")
    if problems:
        raise UsageError(
            f"{len(problems)} files do not compile:\n" + "\n".join(problems),
            hint="fix them, then deploy again",
        )
    return checked


def _syntax_message(path: Path, exc: SyntaxError) -> str:
    line_no = exc.lineno or 0
    where = f"{path}:{line_no}" if line_no else str(path)
    message = f"{where}: {exc.msg}"
    text = exc.text
    if text:
        text = text.rstrip("\n")
        stripped = text.lstrip()
        indent = len(text) - len(stripped)
        column = max((exc.offset or 1) - 1 - indent, 0)
        message += f"\n    {stripped}\n    {' ' * column}^"
    return message
