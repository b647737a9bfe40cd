"""Small file helpers: reading, atomic writing, hashing, the workdir lock."""

import fcntl
import hashlib
import os

from .errors import AgentError


def read_text(path, default=None):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return default


def write_atomic(path, text):
    """Write via a temporary name and rename, so a reader never sees half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def lock_workdir(workdir):
    """One deploy/stop at a time per workdir; the lock dies with the process."""
    os.makedirs(workdir, exist_ok=True)
    fd = os.open(os.path.join(workdir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise AgentError(
            f"another dflashctl deploy, restart or stop is running on {workdir}",
            "wait for it to finish, then try again",
        ) from None
    return fd


def read_int(path):
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def tree_bytes(path):
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def oldest_first(base, names, stamp):
    """Ids carry their UTC second; within one second, the age of `stamp(path)` (a file
    written once, when the release or run at `path` was made) decides."""

    def age(name):
        try:
            mtime = os.stat(stamp(os.path.join(base, name))).st_mtime_ns
        except OSError:
            mtime = 0
        return (name[:15], mtime, name)

    return sorted(names, key=age)
