"""doctor warns when the workdir's free space is less than a checkpoint takes (the
newest checkpoint of its runs, by what its files hold)."""

from __future__ import annotations

import os
import shutil
import sys

from tests.test_deploy_support import write_trainer
from tests.test_doctor import doctor_json


def _config(tmp_path):
    write_trainer(tmp_path / "trainer")
    config = tmp_path / "dflash.yaml"
    config.write_text(
        f"host: {{address: local}}\n"
        f"container: {{vmid: null, workdir: {tmp_path}/work, python: {sys.executable}}}\n"
        "trainer: {entry: train.py}\n"
    )
    return config


def _checkpoint(tmp_path, run, step, size):
    folder = tmp_path / "work" / "runs" / run / "outputs" / "checkpoints" / f"step-{step:06d}"
    folder.mkdir(parents=True)
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(size)  # sparse: what it holds, without the disk it would take
    return folder


def test_a_checkpoint_larger_than_the_free_space_is_warned_of(capsys, monkeypatch, tmp_path):
    config = _config(tmp_path)
    free = shutil.disk_usage(tmp_path).free
    newest = _checkpoint(tmp_path, "r1", 200, free + (1 << 30))
    _, checks = doctor_json(capsys, monkeypatch, config)
    disk = checks["free disk"]
    assert disk["status"] == "warn", disk
    assert "less than a checkpoint takes: the newest, " + str(newest) in disk["detail"]
    assert "runs --prune 5" in disk["detail"]


def test_a_checkpoint_that_fits_is_said_with_the_free_space(capsys, monkeypatch, tmp_path):
    config = _config(tmp_path)
    old = _checkpoint(
        tmp_path, "r1", 100, shutil.disk_usage(tmp_path).free + (1 << 30)
    )  # older: not what the next one needs
    os.utime(old, (1, 1))
    _checkpoint(tmp_path, "r2", 100, 3 << 20)
    _, checks = doctor_json(capsys, monkeypatch, config)
    disk = checks["free disk"]
    assert disk["status"] == "pass", disk
    assert disk["detail"].endswith(", 3.0 MiB per checkpoint")
