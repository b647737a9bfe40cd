"""The trainer's experiment trackers on the real tiny CPU run, offline: W&B's offline run
files and an MLflow file store in the run folder, both holding the step metrics
(grad_norm included) and the resolved config as hyperparameters; and the config errors
for a tracker whose package is missing."""

from __future__ import annotations

import json

import pytest
from dflash.pipeline.trackers import flatten_config, scalars
from dflash.pipeline.train_config import TrainConfigError, config_from_dict

from tests.tiny_run import TinyRun, start_tiny_run

pytestmark = pytest.mark.slow


def _tracked_run(tmp_path, *settings: str) -> TinyRun:
    import subprocess

    proc = start_tiny_run(tmp_path / "run", *settings)
    stdout, stderr = proc.communicate(timeout=300)
    run = TinyRun(
        tmp_path / "run", subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    )
    assert run.exit_code == 0, run.log[-2000:] + run.stderr[-3000:]
    return run


def test_wandb_offline_run_holds_the_metrics_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = _tracked_run(tmp_path, "--set", "logging.wandb={mode: offline, project: tiny}")
    (offline,) = (run.run_dir / "wandb").glob("offline-run-*")
    (records_file,) = offline.glob("run-*.wandb")  # what `wandb sync` uploads
    records = wandb_records(records_file)
    config = {}
    for record in records:  # the run record's config, then any updates
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update
        if kind in ("run", "config"):
            config.update({item.key: json.loads(item.value_json) for item in updates})
    # No deprecated feature used (wandb records them, and warns: a boolean `reinit`).
    deprecated = [
        field.name
        for record in records
        if record.WhichOneof("record_type") == "telemetry"
        for field, used in record.telemetry.deprecated.ListFields()
        if used
    ]
    assert deprecated == []
    start = run.records()[0]["config"]
    assert config["train.steps"] == 40
    assert config["optim.lr"] == pytest.approx(start["optim"]["lr"])
    assert config["logging.wandb.project"] == "tiny"
    history = [
        {
            "_step": record.history.step.num,
            **{
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            },
        }
        for record in records
        if record.WhichOneof("record_type") == "history"
    ]
    steps = [r for r in run.records() if r["kind"] == "step"]
    logged = [h for h in history if "train/loss" in h]
    assert [h["_step"] for h in logged] == [r["step"] for r in steps]
    assert [h["train/loss"] for h in logged] == pytest.approx([r["loss"] for r in steps])
    assert [h["train/grad_norm"] for h in logged] == pytest.approx([r["grad_norm"] for r in steps])
    assert any("eval/tau" in h for h in history)
    assert records[-1].WhichOneof("record_type") in ("exit", "final", "footer") or any(
        r.WhichOneof("record_type") == "exit" for r in records
    )


def wandb_records(path):
    """The protobuf records of a W&B transaction log (.wandb): LevelDB's log format, a
    7-byte header (`:W&B`, magic, version), then 32 KiB blocks of chunks, each with
    crc32 (4), length (2) and type (1: full, 2: first, 3: middle, 4: last)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    records, pending, at = [], b"", 7
    block = 32768
    while at + 7 <= len(data):
        left_in_block = block - at % block
        if left_in_block < 7:  # a block's tail too short for a header is padding
            at += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[at : at + 7])
        if kind == 0 and length == 0:
            at += left_in_block
            continue
        chunk = data[at + 7 : at + 7 + length]
        at += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_mlflow_file_store_holds_the_metrics_and_the_params(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for the reading client here
    run = _tracked_run(tmp_path, "--set", "logging.mlflow={experiment: tiny}")
    store = run.run_dir / "mlruns"
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=store.resolve().as_uri())
    experiment = client.get_experiment_by_name("tiny")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "run" and found.info.status == "FINISHED"
    assert found.data.params["train.steps"] == "40"
    assert found.data.params["runtime.compile"] == "eager"
    history = client.get_metric_history(found.info.run_id, "train/loss")
    steps = [r for r in run.records() if r["kind"] == "step"]
    assert [m.step for m in history] == [r["step"] for r in steps]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in steps])
    norms = client.get_metric_history(found.info.run_id, "train/grad_norm")
    assert [m.value for m in norms] == pytest.approx([r["grad_norm"] for r in steps])


def test_grad_norm_in_the_step_line_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _tracked_run(tmp_path, "--set", "logging.tensorboard=true")
    steps = [r for r in run.records() if r["kind"] == "step"]
    lines = [line for line in run.lines if line.startswith("step ")]
    for line, record in zip(lines, steps, strict=True):
        shown = line.split("| grad_norm ")[1].split(" ")[0]
        assert float(shown) == pytest.approx(record["grad_norm"], rel=5e-3)
        assert record["grad_norm_max"] >= record["grad_norm"] > 0
    events = EventAccumulator(str(run.run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/grad_norm")] == [10, 20, 30, 40]
    (text,) = events.Tensors("config/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert "| train.steps | 40 |" in table


@pytest.mark.parametrize(("key", "package"), [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_tracker_without_its_package_names_the_pip_command(key, package, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == package else real(name, *a),
    )
    with pytest.raises(TrainConfigError) as caught:
        config_from_dict({"logging": {key: True}})
    message = str(caught.value)
    assert f"logging.{key}" in message and f"pip install {package}" in message
    assert config_from_dict({"logging": {key: False}}).logging.model_dump()[key] is None


def test_a_tracker_without_its_package_names_the_setting_that_was_written(monkeypatch):
    import importlib.util

    from dflash.pipeline.train_config import load_train_config

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(TrainConfigError) as caught:
        load_train_config(None, ["logging.wandb.mode=offline"])
    message = str(caught.value)
    assert "--set logging.wandb.mode=offline: logging.wandb.mode: offline needs the wandb " in (
        message
    )
    assert "logging.wandb: true" not in message
    assert "or set logging.wandb: false" in message


def test_flattened_config_and_scalars():
    assert flatten_config({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {
        "a.b": 1,
        "a.c": "[1, 2]",
        "d": None,
    }
    record = {
        "kind": "step",
        "step": 3,
        "time": 1.0,
        "loss": 2.0,
        "mfu": None,
        "acc_per_slot": [0.5, float("nan")],
        "grad_norm": float("inf"),
    }
    assert scalars(record) == {"train/loss": 2.0, "train/acc_per_slot/1": 0.5}
