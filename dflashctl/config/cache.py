"""The validated dflash.yaml, remembered between commands.

Validating the config means building pydantic's validators for every section and
checking every key: about a third of a one-file redeploy's client CPU, every time,
for a file that rarely changes. So the validated Config is kept in the user's cache
folder and taken back as it is when nothing it was made from has changed:

- the file's bytes, and the folder they are resolved against (its path);
- $HOME (`~` in a path);
- dflashctl itself: its version, and the size and mtime of every file in the
  package and of the built-in crash rules (a new release or an edited checkout
  validates afresh).

A config whose validation looked at other files (a `proxmox.verify_tls` CA bundle:
it must exist) is not kept: that file could change unseen. A cache entry that cannot
be read back, or that someone else could have written, is ignored (and replaced):
the config is validated as if there were none.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from platformdirs import user_cache_path

from dflashctl import __version__
from dflashctl.config.private_files import only_ours
from dflashctl.resources import template_path

T = TypeVar("T")
_FORMAT = 1  # bump when what is stored changes shape
_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # all of dflashctl/


def cache_folder() -> Path:
    return user_cache_path("dflashctl", appauthor=False) / "configs"


def _entry_path(path: Path) -> Path:
    name = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return cache_folder() / f"{name}.pickle"


def package_fingerprint() -> str:
    """What changes when dflashctl does: its version and every file's size and mtime."""
    digest = hashlib.sha256(f"{_FORMAT}\0{__version__}".encode())
    files = [template_path("crash_patterns.yaml")]
    for folder, dirs, names in os.walk(_PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "_templates", "schemas"))
        files += [Path(folder, n) for n in sorted(names) if not n.endswith(".pyc")]
    for file in files:
        try:
            info = file.stat()
        except OSError:
            continue
        digest.update(f"{file}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _key(path: Path, text: str) -> str:
    parts = [str(path.resolve()), os.environ.get("HOME", ""), package_fingerprint(), text]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def load(path: Path, text: str, expected: type[T]) -> T | None:
    """The Config validated from exactly this `text` at `path`, or None."""
    entry = _entry_path(path)
    if not only_ours(entry):  # pickle runs what it reads
        return None
    try:
        key, config = pickle.loads(entry.read_bytes())
    except Exception:  # corrupt, cut short, from an older dflashctl: validate afresh
        return None
    if key != _key(path, text) or type(config) is not expected:
        return None
    return config


def _names_a_file(verify_tls: object) -> bool:
    return isinstance(verify_tls, str) and not verify_tls.lower().startswith("sha256:")


def store(path: Path, text: str, config: Any) -> None:
    """Remember `config` (validated from `text` at `path`); never fails the command."""
    if any(_names_a_file(node.proxmox.verify_tls) for node in config.nodes):
        return  # checked against a file (a CA bundle): validate every time
    entry = _entry_path(path)
    try:
        entry.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = pickle.dumps((_key(path, text), config), protocol=pickle.HIGHEST_PROTOCOL)
        fd, staged = tempfile.mkstemp(dir=entry.parent, prefix=".config-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(staged, entry)  # whole or not at all, whoever reads it meanwhile
        except BaseException:
            os.unlink(staged)
            raise
    except (OSError, pickle.PicklingError, TypeError, AttributeError):
        pass  # a read-only or full cache folder: the next command validates again
