"""Releases: immutable copies of the trainer tree in `workdir/releases/<release-id>/`.

`workdir/current` is a symlink to the release the next run starts from; it is swapped
by renaming a new symlink over it, so a reader sees the old tree or the new one, never
a half-written one. The remote work (unpack, link unchanged files, validate, swap,
garbage-collect) is done by the agent (dflashctl/agent/); this module names the
uploads and remembers what this machine deployed last.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from platformdirs import user_cache_path

UPLOAD_PREFIX = "dflashctl-upload-"  # temp archives on the host and in the container


def upload_prefix(workdir: str, vmid: int | None) -> str:
    """Uploads are named per target, so that a deploy clears only its own target's
    leftovers (interrupted uploads), and those only once nobody writes to them."""
    key = str(vmid) if vmid is not None else "host"
    digest = hashlib.sha256(workdir.encode()).hexdigest()[:8]
    return f"{UPLOAD_PREFIX}{key}-{digest}-"


# --------------------------------------------------------------------------- last deploy


@dataclass
class LastDeploy:
    """What this machine last deployed to a target: the release and its manifest.

    With it, a redeploy skips asking the container what it has (one round trip
    less): the agent checks that this release is still current and intact before it
    relies on it, and says `stale` otherwise.
    """

    release: str
    manifest: dict[str, list]


def _cache_path(config: Any) -> Path:
    host, ct = config.host, config.container
    key = json.dumps([host.address, host.port, host.user, ct.vmid, ct.workdir])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    # The platform's per-user cache folder ($XDG_CACHE_HOME or ~/.cache on Linux).
    return user_cache_path("dflashctl", appauthor=False) / "targets" / f"{digest}.json"


def load_last_deploy(config: Any) -> LastDeploy | None:
    try:
        data = json.loads(_cache_path(config).read_text(encoding="utf-8"))
        return LastDeploy(str(data["release"]), dict(data["manifest"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_last_deploy(config: Any, release: str, manifest: dict[str, list]) -> None:
    """Best effort: without the cache a deploy only takes one round trip more."""
    path = _cache_path(config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"release": release, "manifest": manifest}), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass
