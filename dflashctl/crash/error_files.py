"""torchelastic's error files in a run's folder: the exception that ended a rank, as
JSON, written by the trainer (its entry is under `record`) where TORCHELASTIC_ERROR_FILE
points. dflashctl sets that to <run>/error.json and torchrun's log dir to
<run>/torchelastic (each rank's own file: torchelastic/<job>/attempt_<n>/<local rank>/
error.json; torchrun copies the first failed rank's to <run>/error.json).

    {"message": {"message": "RuntimeError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1764630000"}}}

They carry the traceback when the log does not (a rank whose output went elsewhere, a
log cut short). Standard library only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

ERROR_FILE = "error.json"
ELASTIC_LOG_DIR = "torchelastic"
_LOCAL_RANK_DIR = re.compile(r"attempt_(\d+)[/\\](\d+)[/\\]error\.json$")
MAX_FILES = 64
MAX_BYTES = 1 << 20


@dataclass
class ErrorRecord:
    path: str
    message: str
    traceback: list[str] = field(default_factory=list)
    timestamp: int | None = None
    local_rank: int | None = None  # from the folder torchrun gave it
    attempt: int | None = None


def parse_error_file(path: str, text: str) -> ErrorRecord | None:
    """One error file's record; None when it is not torchelastic's format."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):  # torchrun's own errors: a plain message
        return ErrorRecord(path=path, message=message, traceback=[message])
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo") or {}
    said = str(message.get("message") or "")
    stack = str(extra.get("py_callstack") or said)
    try:
        timestamp = int(extra.get("timestamp")) if extra.get("timestamp") else None
    except (TypeError, ValueError):
        timestamp = None
    where = _LOCAL_RANK_DIR.search(path)
    return ErrorRecord(
        path=path,
        message=said,
        traceback=stack.rstrip("\n").splitlines(),
        timestamp=timestamp,
        local_rank=int(where[2]) if where else None,
        attempt=int(where[1]) if where else None,
    )


def read_error_files(run_dir: Path) -> list[ErrorRecord]:
    """The run folder's error files: its own first, then each rank's (newest last)."""
    own = run_dir / ERROR_FILE
    ranks = (run_dir / ELASTIC_LOG_DIR).glob(f"*/attempt_*/*/{ERROR_FILE}")
    records = []
    for path in ([own] if own.is_file() else []) + sorted(ranks, key=_mtime)[-MAX_FILES:]:
        try:
            with path.open("rb") as handle:
                text = handle.read(MAX_BYTES).decode("utf-8", "replace")
        except OSError:
            continue
        record = parse_error_file(str(path), text)
        if record is not None:
            records.append(record)
    return records


# Run in the container by the follower (python -c): the same files, as JSON on stdout.
READER_PROGRAM = r"""
import glob, json, os, sys
run = sys.argv[1]
paths = [os.path.join(run, "error.json")]
paths += sorted(glob.glob(os.path.join(run, "torchelastic", "*", "attempt_*", "*", "error.json")), key=os.path.getmtime)[-64:]
out = []
for path in paths:
    try:
        with open(path, "rb") as handle:
            out.append({"path": path, "text": handle.read(1 << 20).decode("utf-8", "replace")})
    except OSError:
        pass
sys.stdout.write(json.dumps(out))
"""


def records_from_reader(output: str) -> list[ErrorRecord]:
    """READER_PROGRAM's answer as records."""
    try:
        items = json.loads(output or "[]")
    except ValueError:
        return []
    records = []
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            record = parse_error_file(str(item.get("path")), item["text"])
            if record is not None:
                records.append(record)
    return records


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
