"""Experiment trackers beside metrics.jsonl: Weights & Biases and MLflow.

Each is imported only when the trainer config enables it (`logging.wandb`,
`logging.mlflow`); both work offline: W&B with `mode: offline` (or WANDB_MODE=offline)
writes its run files under the run folder, to upload later with `wandb sync`; MLflow
writes to the tracking URI, by default a file store in the run folder (`file:` URI).

A tracker receives what metrics.jsonl receives: the start record's config (stored as
flattened hyperparameters: `optim.lr`, `train.steps`, ...), then step and eval records
as scalars (`train/loss`, `train/grad_norm`, `eval/tau`).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

# Record keys that are not a metric of the step (MetricsWriter skips them for TensorBoard too).
NOT_METRICS = ("kind", "step", "total_steps", "time", "queue_size")


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}; lists as text (trackers'
    hyperparameters take scalars only)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{name}."))
        elif value is None or isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A step or eval record's numbers, named `<kind>/<key>` (lists: one per slot)."""
    prefix = "train" if record.get("kind") == "step" else str(record.get("kind"))
    found: dict[str, float] = {}
    for key, value in record.items():
        if key in NOT_METRICS:
            continue
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            found[f"{prefix}/{key}"] = float(value)
        elif isinstance(value, list):
            for slot, item in enumerate(value, start=1):
                if isinstance(item, (int, float)) and math.isfinite(item):
                    found[f"{prefix}/{key}/{slot}"] = float(item)
    return found


def missing_package(package: str, setting: str, extra: str, written: str = "true") -> str:
    """The config error for an enabled tracker whose package is not installed (`written`:
    the value the key it is said of was given)."""
    return (
        f"{written} needs the {package} package, which is not installed: pip install {package} "
        f"(or dflashctl's `{extra}` extra: pip install 'dflashctl[{extra}]'), or set "
        f"{setting}: false"
    )


class WandbTracker:
    def __init__(self, settings: Any, folder: Path) -> None:
        import wandb

        self._wandb = wandb
        self._settings = settings
        self._folder = folder
        self._run = None

    def start(self, config: dict[str, Any]) -> None:
        if self._run is not None:  # a second start record: the same run goes on
            self._run.config.update(flatten_config(config), allow_val_change=True)
            return
        settings = self._settings
        self._run = self._wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name or self._folder.name,
            mode=settings.mode,  # None: WANDB_MODE, else online
            dir=str(self._folder),
            config=flatten_config(config),
            # A second run in this process finishes the first; the string form, as a
            # boolean is deprecated (wandb >= 0.19.10 warns), the boolean before it.
            reinit=_reinit(self._wandb),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        if self._run is not None and values:
            self._run.log(values, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def _reinit(wandb: Any) -> Any:
    try:
        version = tuple(int(part) for part in wandb.__version__.split(".")[:3])
    except (AttributeError, ValueError):
        return True
    return "finish_previous" if version >= (0, 19, 10) else True


class MlflowTracker:
    """Through MlflowClient with the run's id: mlflow's module-level active run is per
    thread, and the step records come from the drafter thread, the start and the eval
    from the main thread."""

    def __init__(self, settings: Any, folder: Path) -> None:
        from mlflow.tracking import MlflowClient

        self._client_class = MlflowClient
        self._settings = settings
        self._folder = folder
        self._client = None
        self._run_id: str | None = None
        self._params_logged = False

    def start(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        settings = self._settings
        if self._client is None:
            uri = settings.tracking_uri or (self._folder / "mlruns").resolve().as_uri()
            if uri.startswith("file:"):
                # MLflow 3 refuses its file store unless told it is wanted; a file store in
                # the run folder is what works offline with mlflow-skinny (no database).
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            client = self._client_class(tracking_uri=uri)
            experiment = client.get_experiment_by_name(settings.experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else client.create_experiment(settings.experiment)
            )
            run = client.create_run(experiment_id, run_name=settings.run_name or self._folder.name)
            self._client, self._run_id = client, run.info.run_id
        if not self._params_logged:  # MLflow params are write-once: a resume keeps them
            # MLflow caps a value at 6000 characters, and a batch at 100 params.
            params = [Param(k, str(v)[:6000]) for k, v in flatten_config(config).items()]
            for at in range(0, len(params), 100):
                self._client.log_batch(self._run_id, params=params[at : at + 100])
            self._params_logged = True

    def log(self, step: int, values: dict[str, float]) -> None:
        if self._client is None or not values:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for name, value in values.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self) -> None:
        if self._client is not None:
            self._client.set_terminated(self._run_id, "FINISHED")
            self._client = None


def open_trackers(logging_section: Any, folder: Path) -> list[Any]:
    """The trackers the config enables, writing next to metrics.jsonl in `folder`."""
    trackers: list[Any] = []
    if logging_section is None:
        return trackers
    if getattr(logging_section, "wandb", None) is not None:
        trackers.append(WandbTracker(logging_section.wandb, folder))
    if getattr(logging_section, "mlflow", None) is not None:
        trackers.append(MlflowTracker(logging_section.mlflow, folder))
    return trackers
