"""Small file helpers: reading, atomic writing, hashing, the workdir lock."""

import fcntl
import hashlib
import json
import os
import struct
import time
from contextlib import contextmanager

from .errors import AgentError

# <workdir>/pycache: the bytecode cache every run of a workdir shares (runs.bytecode_env).
BYTECODE_DIR = "pycache"


def read_text(path, default=None):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return default


def read_json(path, default=None):
    """The JSON in `path`; `default` when it is missing, unreadable or damaged."""
    text = read_text(path)
    try:
        return json.loads(text) if text else default
    except ValueError:
        return default


def utc(seconds=None):
    """`2026-11-30T18:02:11Z`: now, or the time `seconds` (since the epoch)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def write_best_effort(path, text):
    """write_atomic, but a full disk (or any write error) only leaves the file as it
    was: for records that must never stand between a stop and its signal. True when
    written."""
    try:
        write_atomic(path, text)
    except OSError:
        return False
    return True


def write_atomic(path, text, mode=0o666):
    """Write via a temporary name and rename, so a reader never sees half a file.
    `mode`: the new file's permissions (less the umask)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        remove_file(tmp)  # a full disk leaves no half-written temporary behind
        raise


def remove_file(path):
    """Unlink `path`, if it is there."""
    try:
        os.unlink(path)
    except OSError:
        pass


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# chattr's `T` attribute (FS_TOPDIR_FL) through FS_IOC_GETFLAGS / FS_IOC_SETFLAGS, which
# are _IOR/_IOW('f', 1 / 2, long) (the kernel reads and writes an int at the address).
FS_TOPDIR_FL = 0x00020000
_LONG = struct.calcsize("l")
FS_IOC_GETFLAGS = (2 << 30) | (_LONG << 16) | (ord("f") << 8) | 1
FS_IOC_SETFLAGS = (1 << 30) | (_LONG << 16) | (ord("f") << 8) | 2


def spread_subfolders(folder):
    """Mark `folder` as the top of independent directory trees (`chattr +T`), so ext4
    places each folder made in it in a block group of its own choice rather than next
    to `folder`. Best effort: other filesystems (and ext4 when we may not) say no.

    Why: each release is a new tree of maybe thousands of small files. ext4 gives a new
    file an inode in the first block group of its folder's flex group that has a free
    one, scanning that group's bitmap from its start; without a journal it also skips
    (after reading its inode) every free inode deleted in the last minute or more
    (recently_deleted() in fs/ext4/ialloc.c). Where other trees churn nearby (a test
    suite's temporary files, the previous deploys' cleanup), each new file then scans
    thousands of them: 5,000 files took 2.7 s of kernel time on such a host, 0.1 s in a
    folder placed by the hint. Files in a release are unaffected otherwise."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        raw = fcntl.ioctl(fd, FS_IOC_GETFLAGS, struct.pack("i", 0))
        flags = struct.unpack("i", raw[:4])[0]
        if not flags & FS_TOPDIR_FL:
            fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("i", flags | FS_TOPDIR_FL))
        return True
    except (OSError, struct.error):
        return False
    finally:
        os.close(fd)


def lock_workdir(workdir, holder=None, wait=False):
    """One deploy/restart/stop at a time per workdir; the lock dies with the process.
    The holder ({"command", "machine", "pid"} of the dflashctl that asked) is written
    into the lock file, so a refused caller can say who holds it; `wait` queues."""
    os.makedirs(workdir, exist_ok=True)
    fd = os.open(os.path.join(workdir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        if not wait:
            who = describe_holder(os.pread(fd, 4096, 0))
            os.close(fd)
            raise AgentError(
                f"another dflashctl {who} is in flight on {workdir}",
                "wait for it to finish (or pass --wait to queue behind it), then try again",
            ) from None
        fcntl.flock(fd, fcntl.LOCK_EX)  # queued: blocks until the holder is done
    record = dict(holder or {}, since=utc())
    # Who holds it is only said to a refused caller: a full disk must not refuse the
    # lock (a stop on a full disk still stops). Written over the old record, then cut
    # to length, so the write needs no block the file does not already have, mostly.
    raw = json.dumps(record, sort_keys=True).encode("utf-8")
    try:
        os.pwrite(fd, raw, 0)
        os.ftruncate(fd, len(raw))
    except OSError:
        try:
            os.ftruncate(fd, 0)  # no holder said rather than a stale one
        except OSError:
            pass
    return fd


@contextmanager
def locked(p, wait=None):
    """lock_workdir for a verb's parameters (workdir, holder, wait), released after."""
    fd = lock_workdir(p["workdir"], p.get("holder"), bool(p.get("wait")) if wait is None else wait)
    try:
        yield fd
    finally:
        os.close(fd)


def describe_holder(raw):
    """`deploy (machine laptop, pid 4242, since 2026-11-30T18:02:11Z)` from the lock file."""
    try:
        holder = json.loads(raw.decode("utf-8"))
    except ValueError:
        return "deploy, restart or stop"
    parts = [f"{key} {holder[key]}" for key in ("machine", "pid", "since") if holder.get(key)]
    what = holder.get("command") or "deploy, restart or stop"
    return what + (f" ({', '.join(parts)})" if parts else "")


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
