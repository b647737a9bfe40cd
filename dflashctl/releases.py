"""Releases: immutable copies of the trainer tree in `workdir/releases/<release-id>/`.

`workdir/current` is a symlink to the release the next run starts from; it is swapped
by renaming a new symlink over it, so a reader sees the old tree or the new one, never
a half-written one. The remote work (unpack, link unchanged files, validate, swap,
garbage-collect) is done by the agent (dflashctl/agent.py); this module names things.
"""

from __future__ import annotations

import hashlib
import posixpath

from dflashctl.runs import new_id

MANIFEST_NAME = "MANIFEST.json"
UPLOAD_PREFIX = "dflashctl-upload-"  # temp archives on the host and in the container


def new_release_id() -> str:
    return new_id()


def release_dir(workdir: str, release_id: str) -> str:
    return posixpath.join(workdir, "releases", release_id)


def current_link(workdir: str) -> str:
    return posixpath.join(workdir, "current")


def run_dir(workdir: str, run_id: str) -> str:
    return posixpath.join(workdir, "runs", run_id)


def upload_prefix(workdir: str, vmid: int | None) -> str:
    """Uploads are named per target, so that a deploy clears only its own target's
    leftovers (interrupted uploads), and those only once nobody writes to them."""
    key = str(vmid) if vmid is not None else "host"
    digest = hashlib.sha256(workdir.encode()).hexdigest()[:8]
    return f"{UPLOAD_PREFIX}{key}-{digest}-"


def upload_path(prefix: str, release_id: str, folder: str = "/tmp") -> str:
    """Where the archive of changed files waits before it is unpacked (removed after)."""
    return posixpath.join(folder, f"{prefix}{release_id}.tar.gz")
