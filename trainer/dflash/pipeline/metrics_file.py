"""Where a run's numbers go besides the log: ``metrics.jsonl`` and, when asked for,
TensorBoard event files.

``metrics.jsonl`` holds one JSON object per line, appended and flushed as the run goes
(a reader never waits for the end, and a crash loses nothing already logged):

    {"kind": "step", "step": 60, "total_steps": 600, "time": 1764400000.1, "loss": 5.76,
     "acc": 0.15, "acc_per_slot": [0.3, 0.1, 0.05], "tau": 1.39, "lr": 0.0099,
     "tokens_per_s": 9209.0, "steps_per_s": 12.0, "mfu": null, "queue_depth": 4,
     "queue_size": 4, "elapsed_s": 5.0, "eta_s": 45.0}
    {"kind": "eval", "step": 600, "time": ..., "tau": 1.63, "lossless": true, ...}

and first, at each start, ``{"kind": "start", "step": <first step - 1>, "config": {...}}``
with the resolved config.

It lives in the run folder dflashctl made (``$DFLASH_RUN_DIR``), where ``dflashctl runs
show`` reads it; run by hand, in ``output_dir``. A resumed run appends to the same file
when it has the same folder: steps then start again from the checkpoint's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def metrics_dir(output_dir: Path) -> Path:
    """The run folder when dflashctl launched us, else output_dir."""
    run_dir = os.environ.get("DFLASH_RUN_DIR")
    return Path(run_dir) if run_dir else Path(output_dir)


def tensorboard_available() -> bool:
    """Is the package torch.utils.tensorboard needs installed? (Cheap: imports nothing.)"""
    return importlib.util.find_spec("tensorboard") is not None


class MetricsWriter:
    """Appends records to metrics.jsonl (and scalars to TensorBoard). Used by one thread
    at a time: drafter-0 while training, the main thread after it has been joined."""

    def __init__(self, folder: Path, *, tensorboard: bool = False) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / METRICS_FILE
        self._file = self.path.open("a", encoding="utf-8")
        self._board = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._board = SummaryWriter(log_dir=str(folder / TENSORBOARD_DIR))

    def write(self, record: dict[str, Any]) -> None:
        if self._file.closed:
            return
        self._file.write(json.dumps(_finite(record), separators=(", ", ": ")) + "\n")
        self._file.flush()
        if self._board is not None:
            self._to_board(record)

    def _to_board(self, record: dict[str, Any]) -> None:
        if record.get("kind") == "start":
            return
        prefix = "train" if record.get("kind") == "step" else str(record.get("kind"))
        step = int(record["step"])
        for key, value in record.items():
            if key in ("kind", "step", "total_steps", "time", "queue_size"):
                continue
            if isinstance(value, bool):
                value = float(value)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._board.add_scalar(f"{prefix}/{key}", value, step, walltime=record.get("time"))
            elif isinstance(value, list):
                for slot, item in enumerate(value, start=1):
                    self._board.add_scalar(f"{prefix}/{key}/{slot}", item, step)
        self._board.flush()

    def close(self) -> None:
        if self._board is not None:
            self._board.close()
            self._board = None
        if not self._file.closed:
            self._file.close()


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN or infinity: they become null (a reader then shows a gap)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        elif isinstance(value, list):
            value = [None if isinstance(v, float) and not math.isfinite(v) else v for v in value]
        out[key] = value
    return out
