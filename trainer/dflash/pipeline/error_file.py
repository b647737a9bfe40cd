"""torchelastic's error file: the exception that ended this process, as JSON, where
TORCHELASTIC_ERROR_FILE says (torchrun sets it for each rank; dflashctl sets it under
the run folder for a plain run). torchrun's "Root Cause (first observed failure)" then
carries the traceback instead of `error_file: <N/A>`.

torch's own `record` decorator (on the entry point too) writes the file only for an
exception that leaves main(); the trainer ends a failed run with os._exit after logging
the failure of a thread, which no decorator sees. Same format as
torch.distributed.elastic.multiprocessing.errors.ErrorHandler.record_exception.
"""

from __future__ import annotations

import json
import os
import time
import traceback


def record_exception(exc: BaseException, environ: dict | None = None) -> str | None:
    """Write `exc` to the error file; its path, or None when there is none (best effort)."""
    env = os.environ if environ is None else environ
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return None
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(
                    traceback.format_exception(type(exc), exc, exc.__traceback__)
                ),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
    except OSError:  # a full disk, say: the log still has the traceback
        return None
    return path
