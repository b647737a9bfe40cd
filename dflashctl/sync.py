"""What to send: the manifest of the local trainer tree, and an archive of what changed.

The manifest maps each file's path (relative, with "/") to [size, sha256, mode]
(mode "755" for a file its owner may execute, else "644": a `chmod +x` alone is a
change that deploys) after
`trainer.exclude`, which uses .gitignore syntax: `*` and `?` stay inside one path
segment, `**` spans segments, a trailing `/` matches folders only, a pattern with a
`/` before its end is anchored at the tree's top, `!` re-includes what an earlier
pattern excluded (not inside an excluded folder, as in git), `#` starts a comment.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# One definition of the manifest's name and file modes, shared with the agent that
# checks releases where the trainer runs.
from dflashctl.agent.manifest import MANIFEST_NAME, file_mode
from dflashctl.errors import UsageError

Manifest = dict[str, list]  # path -> [size, sha256, mode]


# --------------------------------------------------------------------------- excludes


@dataclass(frozen=True)
class _Rule:
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool


def _segment_regex(glob: str) -> str:
    out = []
    i = 0
    while i < len(glob):
        c = glob[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = glob.find("]", i + 2 if glob[i + 1 : i + 2] in ("!", "]") else i + 1)
            if end == -1:
                out.append(re.escape(c))
            else:
                body = glob[i + 1 : end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body.replace(chr(92), chr(92) * 2)}]")
                i = end
        elif c == "\\" and i + 1 < len(glob):
            i += 1
            out.append(re.escape(glob[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _compile(pattern: str) -> _Rule | None:
    line = pattern.rstrip("\n")
    if not line.strip() or line.startswith("#"):
        return None
    negate = line.startswith("!")
    if negate:
        line = line[1:]
    line = line.rstrip(" ")
    dir_only = line.endswith("/")
    line = line.rstrip("/")
    if not line:
        return None
    anchored = "/" in line
    line = line.lstrip("/")
    parts = line.split("/")
    regex = []
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        if part == "**":
            # `a/**/b` matches a/b too; a trailing `**` matches everything inside.
            regex.append(".*" if last else "(?:.*/)?")
        else:
            regex.append(_segment_regex(part) + ("" if last else "/"))
    body = "".join(regex)
    prefix = "" if anchored else "(?:.*/)?"
    return _Rule(re.compile(f"^{prefix}{body}$"), negate, dir_only)


class Excludes:
    """gitignore-style matcher for paths relative to the trainer source."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = list(patterns)
        self._rules = [r for r in map(_compile, self.patterns) if r is not None]

    def excluded(self, rel_path: str, is_dir: bool) -> bool:
        result = False
        for rule in self._rules:
            if rule.dir_only and not is_dir:
                continue
            if rule.regex.match(rel_path):
                result = not rule.negate
        return result


# --------------------------------------------------------------------------- manifest


def iter_files(source: Path, excludes: Excludes) -> Iterator[str]:
    """Relative paths of the files to deploy; excluded folders are not entered.

    A symlink is deployed as what it points at (a file, or a folder's files); a link
    back to a folder above it is not followed twice.
    """
    yield from _walk(Path(source), "", excludes, frozenset([os.path.realpath(source)]))


def _walk(folder: Path, prefix: str, excludes: Excludes, seen: frozenset) -> Iterator[str]:
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError as exc:
        raise UsageError(
            f"cannot read {folder}: {exc.strerror}",
            hint="make it readable, or leave it out with trainer.exclude",
        ) from None
    for entry in entries:
        rel = prefix + entry.name
        if entry.is_dir():
            real = os.path.realpath(entry.path)
            if excludes.excluded(rel, True) or real in seen:
                continue
            yield from _walk(Path(entry.path), rel + "/", excludes, seen | {real})
        elif entry.is_file() and not excludes.excluded(rel, False):
            yield rel  # (dangling links, sockets and fifos are neither)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(source: Path, exclude: Iterable[str]) -> Manifest:
    source = Path(source)
    if not source.is_dir():
        raise UsageError(
            f"trainer.source {source} is not a folder",
            hint="point trainer.source in dflash.yaml at the trainer's folder",
        )
    excludes = Excludes(exclude)
    manifest: Manifest = {}
    for rel in iter_files(source, excludes):
        path = source / rel
        stat = path.stat()
        manifest[rel] = [stat.st_size, sha256_file(path), file_mode(stat.st_mode)]
    return manifest


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
    unchanged = sorted(p for p in local if p not in changed)
    return Diff(changed, removed, unchanged)


# --------------------------------------------------------------------------- archive


def make_archive(source: Path, manifest: Manifest, paths: Iterable[str]) -> bytes:
    """A gzip'd tar of MANIFEST.json (the whole new tree) and the files in `paths`.

    Each file is read once and checked against the manifest, so a file edited while
    we pack it is reported instead of deployed half-old, half-new.
    """
    buffer = io.BytesIO()
    # Level 1: the code is small and the link fast; the time goes into compressing.
    with tarfile.open(
        fileobj=buffer, mode="w:gz", compresslevel=1, format=tarfile.PAX_FORMAT
    ) as tar:
        text = json.dumps(manifest, sort_keys=True).encode()
        _add_bytes(tar, MANIFEST_NAME, text, 0o644)
        for rel in paths:
            path = Path(source) / rel
            data = path.read_bytes()
            size, sha, mode = manifest[rel]
            if [len(data), hashlib.sha256(data).hexdigest()] != [size, sha]:
                raise UsageError(
                    f"{path} changed while it was being packed",
                    hint="run the deploy again once your editor has saved",
                )
            _add_bytes(tar, rel, data, int(mode, 8))
    return buffer.getvalue()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


# --------------------------------------------------------------------------- preflight


def check_syntax(source: Path, manifest: Manifest) -> int:
    """Compile every .py file; the first syntax error becomes a UsageError naming
    file:line with the offending line and a caret. Returns how many were checked."""
    checked = 0
    for rel in sorted(manifest):
        if not rel.endswith(".py"):
            continue
        path = Path(source) / rel
        text = path.read_bytes()
        try:
            compile(text, str(path), "exec", dont_inherit=True)
        except SyntaxError as exc:
            raise UsageError(_syntax_message(path, exc), hint="fix it, then deploy again") from None
        except ValueError as exc:  # e.g. null bytes in the source
            raise UsageError(f"{path}: cannot compile: {exc}") from None
        checked += 1
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
