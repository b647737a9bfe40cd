"""Files dflashctl reads back from its own cache and then trusts: a pickled config
(config/cache.py) and remembered command lines (ops/early_upload.py). Standard library only:
early_upload uses it before the CLI is imported."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def only_ours(file: Path) -> bool:
    """A regular file of ours, in a folder of ours, neither writable by anyone else:
    what it holds is run, so nothing another user could have written."""
    try:
        info, folder = os.lstat(file), os.lstat(file.parent)
    except OSError:
        return False
    uid = os.getuid()
    return (
        stat.S_ISREG(info.st_mode)
        and info.st_uid == folder.st_uid == uid
        and not (info.st_mode | folder.st_mode) & 0o022
    )
