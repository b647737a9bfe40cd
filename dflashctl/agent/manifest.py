"""The manifest of a release: the one definition dflashctl/sync.py (which writes it,
on our side) and the agent (which checks it, where the trainer runs) share.

A manifest maps each file's path (relative, with "/") to [size, sha256, mode]: mode
"755" for a file its owner may execute, else "644", so a `chmod +x` alone is a change
that deploys.
"""

import json
import os

from .files import read_text, sha256_file, write_atomic

# dflashctl's record of a release (its manifest, and the stat of each file when it was
# checked) lives beside the release, `releases/<id>.manifest.json`, so that no file of
# the trainer (a MANIFEST.json of its own included) can collide with it. In the
# uploaded archive it is the first member, whatever that member's name.
METADATA_SUFFIX = ".manifest.json"


def file_mode(st_mode):
    """A file's permissions as a release keeps them (`"644"`, `"600"`, `"750"`): a
    file only its owner may read stays so where the trainer runs, and comes back so
    with `pull`."""
    return "%03o" % (st_mode & 0o777)


def metadata_path(release_dir):
    return release_dir.rstrip("/") + METADATA_SUFFIX


def stat_identity(st):
    """What must be unchanged for a file to be taken as not edited since it was hashed
    (as git's index does): size, inode, mtime. Hard links share all three."""
    return [st.st_size, st.st_ino, st.st_mtime_ns]


def read_metadata(release_dir):
    """(manifest, stats) recorded for a release; empty for one without a record."""
    text = read_text(metadata_path(release_dir))
    try:
        data = json.loads(text) if text is not None else {}
        return dict(data["manifest"]), dict(data["stats"])
    except (ValueError, KeyError, TypeError):
        return {}, {}


def write_metadata(release_dir, manifest, stats):
    write_atomic(
        metadata_path(release_dir),
        json.dumps({"manifest": manifest, "stats": stats}, sort_keys=True),
    )


def real_manifest(release_dir):
    """The release's manifest checked against its files: a file edited in place
    (or removed) since it was deployed gets its real size and hash, or is left out,
    so the next deploy sends it again. A file whose stat is as recorded is not read
    again; files the run wrote into its release (`__pycache__`) are not in the
    manifest and play no part."""
    recorded, stats = read_metadata(release_dir)
    manifest = {}
    for rel, entry in recorded.items():
        path = os.path.join(release_dir, rel)
        try:
            st = os.stat(path)
            unchanged = stats.get(rel) == stat_identity(st)
            sha = entry[1] if unchanged else sha256_file(path)
            manifest[rel] = [st.st_size, sha, file_mode(st.st_mode)]
        except OSError:
            continue
    return manifest
