"""The bundled trainer names its failures for dflashctl: a tokenizer larger than the
target's vocabulary is refused before training starts, naming both sizes; the exception
that ends a run is recorded in torchelastic's error file, which `logs --file` reads from
the run folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.json_answers import flat

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "trainer"
QUICK = ["--set", "train.steps=20", "--set", "data.num_samples=16", "--set", "eval.enabled=false"]


def train(run_dir: Path, *sets: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "train_dflash_pipeline.py", "--config", "configs/tiny-cpu.yaml"]
    for item in sets:
        command += ["--set", item]
    env = {
        **os.environ,
        "DFLASH_RUN_DIR": str(run_dir),
        "PYTHONUNBUFFERED": "1",
        "TORCHELASTIC_ERROR_FILE": str(run_dir / "error.json"),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        command + QUICK, cwd=TRAINER, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_tokenizer_larger_than_the_vocabulary_fails_before_training(tmp_path):
    sys.path.insert(0, str(TRAINER))
    from dflash.data import build_tiny_tokenizer

    build_tiny_tokenizer(600).save_pretrained(str(tmp_path / "tokenizer"))
    run = train(tmp_path / "run", f"data.tokenizer={tmp_path / 'tokenizer'}")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "has 600 tokens but the target's vocabulary has 512" in run.stderr
    assert "step " not in run.stdout  # refused before a single step


def test_the_failure_is_recorded_for_torchrun_and_read_back_by_logs(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "fine"}\n{"text": "cut off\n')
    run_dir = tmp_path / "run"
    run = train(run_dir, f"data.source={data}")
    assert run.returncode == 1
    recorded = json.loads((run_dir / "error.json").read_text())
    assert recorded["message"]["message"].startswith("ValueError: ")
    assert "read_records" in recorded["message"]["extraInfo"]["py_callstack"]
    # The run folder with a log that lost its end: the error file still names it.
    (run_dir / "train.log").write_text(run.stdout.split("main failed:")[0])
    logs = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflashctl",
            "logs",
            "--file",
            str(run_dir / "train.log"),
            "--exit-code",
            "1",
            "--json",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert logs.returncode == 1, logs.stderr
    [root] = flat(json.loads(logs.stdout))["crashes"]
    assert root["category"] == "data_error" and root["root_cause"]
    assert root["details"]["error_file"] == str(run_dir / "error.json")
    assert root["details"]["file"] == str(data) and root["details"]["line"] == 2


def test_bad_utf8_deep_in_a_jsonl_file_names_its_line_and_byte(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
    from dflash.data import read_records

    data = tmp_path / "train.jsonl"
    good = b'{"text": "fine"}\n' * 399
    data.write_bytes(good + b'{"text": "bad \xff byte"}\n')
    with pytest.raises(ValueError) as failed:
        read_records(data)
    said = str(failed.value)
    assert said.startswith(f"{data}:400: not valid UTF-8 (byte {len(good) + 14} of the file")
