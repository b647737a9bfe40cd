"""The real trainer deployed into a container of the test host (a real sshd on loopback,
a bubblewrap container), then `dflashctl runs show` reading its metrics.jsonl over SSH."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.json_answers import flat
from tests.tiny_run import QUICK

pytestmark = pytest.mark.slow

DFLASHCTL = [sys.executable, "-m", "dflashctl"]


def dflashctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASHCTL, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "100"},
    )


def test_runs_show_reads_the_trainers_metrics_in_the_container(
    tmp_path, container, write_config, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = str(write_config(tmp_path))  # the bundled trainer, configs/tiny-cpu.yaml
    deployed = dflashctl("deploy", "-c", path, "--", *QUICK, timeout=300)
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    step_lines = [line for line in deployed.stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 4 and step_lines[-1].endswith("| eta 0s")

    shown = dflashctl("runs", "show", "-c", path, "--json")
    assert shown.returncode == 0, shown.stderr
    (run,) = flat(json.loads(shown.stdout))["runs"]
    assert run["run"]["state"] == "finished (exit 0)" and run["lineage"] == [run["run"]["id"]]
    assert [r["step"] for r in run["steps"]] == [10, 20, 30, 40]
    for line, record in zip(step_lines, run["steps"], strict=True):
        assert line.startswith(f"step {record['step']}/40 | loss {record['loss']:.4f} | ")
    assert run["evals"][0]["lossless"] is True
    # Everything lives in the container: nothing of the run on this side.
    run_dir = container.host_path(f"/root/dflash/runs/{run['run']['id']}")
    assert (run_dir / "metrics.jsonl").is_file()

    png = tmp_path / "run.png"
    drawn = dflashctl("runs", "show", run["run"]["id"], "-c", path, "--png", str(png))
    assert drawn.returncode == 0, drawn.stderr
    # (the place reads "CT 200 on ..." or "container 200 on ...": being made one wording)
    assert re.search(rf"^run +{run['run']['id']} on (CT|container) 200 on ", drawn.stdout, re.M)
    assert "progress   step 40/40" in drawn.stdout and "\ntokens/s   last " in drawn.stdout
    assert png.read_bytes()[:4] == b"\x89PNG" and f"wrote {png}" in drawn.stderr
