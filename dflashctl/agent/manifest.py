"""The manifest of a release: the one definition dflashctl/sync.py (which writes it,
on our side) and the agent (which checks it, where the trainer runs) share.

A manifest maps each file's path (relative, with "/") to [size, sha256, mode]: mode
"755" for a file its owner may execute, else "644", so a `chmod +x` alone is a change
that deploys.
"""

import json
import os

from .files import read_text, sha256_file

MANIFEST_NAME = "MANIFEST.json"


def file_mode(st_mode):
    """The part of a file's permissions a release keeps: executable by its owner or not."""
    return "755" if st_mode & 0o100 else "644"


def real_manifest(release_dir):
    """The release's manifest checked against its files: a file edited in place
    (or removed) since it was deployed gets its real size and hash, or is left out,
    so the next deploy sends it again."""
    text = read_text(os.path.join(release_dir, MANIFEST_NAME))
    if text is None:
        return {}
    try:
        recorded = json.loads(text)
    except ValueError:
        return {}
    manifest = {}
    for rel in recorded:
        path = os.path.join(release_dir, rel)
        try:
            st = os.stat(path)
            manifest[rel] = [st.st_size, sha256_file(path), file_mode(st.st_mode)]
        except OSError:
            continue
    return manifest
