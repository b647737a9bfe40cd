"""Releases: immutable copies of the trainer tree in `workdir/releases/<release-id>/`.

`workdir/current` is a symlink to the release the next run starts from; it is swapped
by renaming a new symlink over it, so a reader sees the old tree or the new one, never
a half-written one. The remote work (unpack, link unchanged files, validate, swap,
garbage-collect) is done by the agent (dflashctl/agent.py); this module names things.
"""

from __future__ import annotations

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


def upload_path(release_id: str, folder: str = "/tmp") -> str:
    """Where the archive of changed files waits before it is unpacked (removed after)."""
    return posixpath.join(folder, f"{UPLOAD_PREFIX}{release_id}.tar.gz")
