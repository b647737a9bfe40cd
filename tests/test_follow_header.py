"""Following a run (deploy, restart, logs -f) shows the trainer's resolved config as one
line; train.log and `logs` without -f keep every line of it."""

from __future__ import annotations

import json
from pathlib import Path

from dflash.pipeline.logging import header_lines

from tests.test_help import dflashctl, local_config

TRAINER = Path(__file__).resolve().parents[1] / "trainer"


def test_following_collapses_the_trainers_config_block(tmp_path):
    config = {"train": {"steps": 3, "log_every": 1}, "optim": {"lr": 0.01, "warmup_ratio": 0.04}}
    header = header_lines(config, ["cpu"], TRAINER)  # the real trainer's header
    path = local_config(tmp_path)
    (tmp_path / "src" / "train.py").write_text(
        f"lines = {json.dumps(header)}\n"
        "print('\\n'.join(lines), flush=True)\n"
        "for step in (1, 2, 3):\n"
        "    print(f'step {step}/3 | loss 1.0', flush=True)\n"
    )
    done = dflashctl("deploy", "-c", str(path))
    assert done.returncode == 0, done.stderr
    shown = done.stdout.splitlines()
    assert (
        shown.count(
            "config: (its lines are in train.log; `dflashctl runs show` shows the run's settings)"
        )
        == 1
    ), done.stdout
    assert not any(line.startswith("  train:") or "warmup_ratio" in line for line in shown)
    assert "step 3/3 | loss 1.0" in done.stdout
    assert any(line.startswith("versions: python") for line in shown)

    log = next((tmp_path / "w" / "runs").iterdir()) / "train.log"
    assert "warmup_ratio: 0.04" in log.read_text()
    plain = dflashctl("logs", "-c", str(path))
    assert "warmup_ratio: 0.04" in plain.stdout, plain.stdout
