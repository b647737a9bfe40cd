"""The manifest of a release: the one definition dflashctl/ops/sync.py (which writes it,
on our side) and the agent (which checks it, where the trainer runs) share.

A manifest maps each file's path (relative, with "/") to [size, sha256, mode] (the
permissions in octal: "644", "755", "600"), so a `chmod` alone is a change that
deploys; and each symbolic link's path to ["link", target], the link's own text (a
relative path that stays inside the release), so a link travels as a link, as
`rsync -l`, git and docker keep one, and a link that became a file (or the other way
round) is a change.
"""

import json
import os
import stat

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


LINK = "link"


def is_link(entry):
    return len(entry) == 2 and entry[0] == LINK


def link_entry(target):
    return [LINK, target]


def link_stays_inside(rel, target):
    """Does the link at `rel` (a release-relative path) with text `target` name a place
    inside the release, read as the text says? (Not enough alone: a ".." after another
    link goes where that link leads; the agent checks the links it made once all are
    there.)"""
    if not target or "\0" in target or target.startswith("/"):
        return False
    where = os.path.normpath(os.path.join(os.path.dirname(rel), target))
    return where != ".." and not where.startswith("../")


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
    manifest and play no part. A link is read as a link (never followed): one put in
    a file's place, or a file in a link's, is a change."""
    recorded, stats = read_metadata(release_dir)
    manifest = {}
    for rel, entry in recorded.items():
        path = os.path.join(release_dir, rel)
        try:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                manifest[rel] = link_entry(os.readlink(path))
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            unchanged = not is_link(entry) and stats.get(rel) == stat_identity(st)
            sha = entry[1] if unchanged else sha256_file(path)
            manifest[rel] = [st.st_size, sha, file_mode(st.st_mode)]
        except OSError:
            continue
    return manifest
