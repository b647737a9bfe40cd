"""What this machine already knows about a trainer tree's files, so that a redeploy
next to a big unchanged file does not read it again.

Per source folder, `~/.cache/dflashctl/sources/<digest>.json` keeps each file's sha256
under its (size, mtime_ns, inode), as git's index does, and the hashes of the .py
contents known to compile. A file whose stat differs is hashed again. A file modified
within the last seconds is not remembered ("racy": a second edit in the same mtime tick
would go unseen). Best effort: without the cache everything is simply hashed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from platformdirs import user_cache_path

RACY_NS = 2_000_000_000  # files changed this recently are hashed every time


def _path(source: Path) -> Path:
    digest = hashlib.sha256(os.path.realpath(source).encode()).hexdigest()[:24]
    # Beside what releases.py remembers of each target (XDG_CACHE_HOME on Linux).
    return user_cache_path("dflashctl", appauthor=False) / "sources" / f"{digest}.json"


class SourceCache:
    def __init__(self, source: Path) -> None:
        self.path = _path(source)
        self.started_ns = time.time_ns()
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            self._files: dict[str, list] = dict(data["files"])
            self._compiles: set[str] = set(data["compiles"])
        except (OSError, ValueError, KeyError, TypeError):
            self._files, self._compiles = {}, set()
        self._seen: dict[str, list] = {}

    @staticmethod
    def _key(stat: os.stat_result) -> list:
        return [stat.st_size, stat.st_mtime_ns, stat.st_ino]

    @classmethod
    def same_file(cls, before: os.stat_result, after: os.stat_result) -> bool:
        """Nothing wrote to the file between the two stats (as this cache judges)."""
        return cls._key(before) == cls._key(after) and before.st_ctime_ns == after.st_ctime_ns

    def sha256(self, rel: str, stat: os.stat_result) -> str | None:
        """The file's sha256 if it is known for exactly this stat, else None."""
        entry = self._files.get(rel)
        if entry is not None and entry[:3] == self._key(stat):
            self._seen[rel] = entry
            return entry[3]
        return None

    def remember(self, rel: str, stat: os.stat_result, sha: str, *, after: os.stat_result) -> None:
        """`sha` was read from the file between `stat` and `after`."""
        key = self._key(stat)
        if key == self._key(after) and stat.st_mtime_ns < self.started_ns - RACY_NS:
            self._seen[rel] = [*key, sha]

    def compiles(self, sha: str) -> bool:
        return sha in self._compiles

    def compiled(self, sha: str) -> None:
        self._compiles.add(sha)

    def save(self, manifest: dict[str, list]) -> None:
        """Keep what this scan saw (files gone from the tree are forgotten)."""
        shas = {entry[1] for entry in manifest.values() if len(entry) == 3}  # (not links)
        data = {
            "files": self._seen,
            "compiles": sorted(self._compiles & shas),
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(data), encoding="utf-8")
            tmp.replace(self.path)
        except OSError:
            pass
