"""A real full filesystem for the tests: a small tmpfs mounted where a workdir goes,
filled to the last byte on demand, and emptied again.

Mounting needs root (the container tests' host needs it anyway); without it the tests
that use it skip and say why.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

FILLER = ".filler"


def mount_small_disk(folder: Path, size_mb: int = 64) -> str | None:
    """A tmpfs of `size_mb` on `folder` (made if missing); None when mounted, else why not."""
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return "no mount(8) here"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return f"cannot mount a tmpfs on {folder} (needs root): {done.stderr.strip()}"
    return None


def unmount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(folder: Path) -> int:
    """Write zeros into `folder`'s filesystem until not one more byte fits; the bytes
    written. Smaller and smaller writes take the last partial pages too."""
    written = 0
    fd = os.open(folder / FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (1 << 20, 1 << 12, 1):
            block = b"\0" * size
            while True:
                try:
                    written += os.write(fd, block)
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    break
    finally:
        os.close(fd)
    return written


def is_full(folder: Path) -> bool:
    """Does a one-byte write of a new file fail for want of space?"""
    probe = folder / ".probe"
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
    except OSError as exc:
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return False


def empty(folder: Path) -> None:
    try:
        (folder / FILLER).unlink()
    except FileNotFoundError:
        pass
