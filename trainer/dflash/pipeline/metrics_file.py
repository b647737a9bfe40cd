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
with the resolved config. ``tau`` is tau~: what speculative decoding of the step's text
would measure (dflash/serving_walk.py), ``tau_anchors`` the mean acceptance over the
window's sampled anchors. ``grad_norm`` is the window's mean total gradient norm before
clipping (``grad_norm_max`` its largest). TensorBoard and the trackers (trackers.py) get
the same numbers, and the config as hyperparameters.

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

from dflash.pipeline.trackers import flatten_config, scalars

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

    def __init__(
        self, folder: Path, *, tensorboard: bool = False, trackers: list[Any] | None = None
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.trackers = list(trackers or [])
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
        if record.get("kind") == "start":
            self._start(record.get("config") or {})
            return
        values = scalars(record)
        step = int(record["step"])
        if self._board is not None:
            for name, value in values.items():
                self._board.add_scalar(name, value, step, walltime=record.get("time"))
            self._board.flush()
        for tracker in self.trackers:
            tracker.log(step, values)

    def _start(self, config: dict[str, Any]) -> None:
        """The resolved config as hyperparameters: a TensorBoard text table (its HPARAMS
        tab wants a metric per run, which a running job does not have yet), W&B's config,
        MLflow's params."""
        if self._board is not None:
            rows = [f"| {key} | {value} |" for key, value in flatten_config(config).items()]
            self._board.add_text("config", "\n".join(["| key | value |", "|---|---|", *rows]))
            self._board.flush()
        for tracker in self.trackers:
            tracker.start(config)

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()
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
