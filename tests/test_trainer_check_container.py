# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""The trainer's config is checked in the container, with the new release and the run's
interpreter, before the healthy old run is stopped: a typo in a `--set` and a tracker
whose package is missing are refused with the old run untouched; doctor says the same."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.json_answers import flat

pytestmark = pytest.mark.slow

WORKDIR = "/root/dflash"
DFLASHCTL = [sys.executable, "-m", "dflashctl"]
TRAINER = Path(__file__).resolve().parents[1] / "trainer"
SITE = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
VENV2 = "/root/py-without-tensorboard"
# The tiny CPU run, held after its first step until SIGTERM: a healthy run to keep.
ARGS = [
    "--config",
    "configs/tiny-cpu.yaml",
    *("--set", "data.num_samples=32", "--set", "eval.enabled=false"),
    *("--set", "train.log_every=1", "--set", "debug.hold_at_step=1"),
]


def cli(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASHCTL, args[0], "-c", str(path), *args[1:]],
        capture_output=True,
        text=True,
        timeout=600,
    )


def interpreter_without_tensorboard(container) -> str:
    """A venv in the container that sees the test interpreter's packages but tensorboard:
    each entry of its site-packages linked, tensorboard's left out."""
    made = container.exec(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", VENV2]
    )
    assert made.returncode == 0, made.stderr
    found = container.exec(
        [f"{VENV2}/bin/python", "-c", "import site; print(site.getsitepackages()[0])"]
    )
    site = container.host_path(found.stdout.strip())
    for entry in Path(SITE).iterdir():
        if not entry.name.startswith("tensorboard"):
            (site / entry.name).symlink_to(entry)
    return f"{VENV2}/bin/python"


@pytest.fixture
def project(tmp_path, container, write_config, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_config(
        tmp_path,
        trainer_source=TRAINER,
        **{
            "trainer.entry": "train_dflash_pipeline.py",
            "trainer.args": ARGS,
            "container.python": interpreter_without_tensorboard(container),
        },
    )
    return path, container


def wait_for(container, run_id: str, want: str) -> None:
    log = container.host_path(f"{WORKDIR}/runs/{run_id}/train.log")
    deadline = time.monotonic() + 300
    while want not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.5)


def status_of(path: Path, run_id: str) -> str:
    done = cli(path, "runs", "--json")
    assert done.returncode == 0, done.stderr
    return next(r for r in flat(json.loads(done.stdout))["runs"] if r["id"] == run_id)["status"]


@pytest.mark.timeout(900)  # the real trainer's start, twice doctor's torch: minutes when busy
def test_a_trainer_config_mistake_is_refused_before_the_old_run_is_stopped(project):
    path, container = project
    first = cli(path, "deploy", "--detach")
    assert first.returncode == 0, first.stdout + first.stderr
    run_id = (first.stdout + first.stderr).split("launched run ", 1)[1].split()[0]
    wait_for(container, run_id, "step 1/")
    runs_before = sorted(p.name for p in container.host_path(f"{WORKDIR}/runs").iterdir())

    typo = cli(path, "deploy", "--detach", "--", "--set", "train.stepz=20000")
    said = typo.stdout + typo.stderr
    assert typo.returncode == 2, said
    assert "unknown key train.stepz (did you mean train.steps?)" in typo.stderr
    assert "nothing was stopped" in typo.stderr
    assert "stopped run" not in said and "launched run" not in said

    tracker = cli(path, "deploy", "--detach", "--", "--set", "logging.tensorboard=true")
    assert tracker.returncode == 2, tracker.stdout + tracker.stderr
    assert "logging.tensorboard" in tracker.stderr
    assert "needs the tensorboard package, which is not installed" in tracker.stderr

    # The healthy run trains on, untouched, and no run was added.
    assert container.host_path(f"{WORKDIR}/active_run").read_text().strip() == run_id
    assert status_of(path, run_id) == "running"
    assert "stopped by" not in container.host_path(f"{WORKDIR}/runs/{run_id}/train.log").read_text()
    after = sorted(p.name for p in container.host_path(f"{WORKDIR}/runs").iterdir())
    assert after == runs_before

    # doctor runs the same check: the deployed trainer, with the run's interpreter.
    checks = doctor_checks(path)
    assert checks["trainer config"]["status"] == "pass", checks["trainer config"]
    data = yaml.safe_load(path.read_text())
    data["trainer"]["args"] = [*ARGS, "--set", "logging.tensorboard=true"]
    path.write_text(yaml.safe_dump(data))
    doctor = cli(path, "doctor", "--json")
    assert doctor.returncode == 2, doctor.stdout
    check = {c["name"]: c for c in flat(json.loads(doctor.stdout))["checks"]}["trainer config"]
    assert check["status"] == "fail"
    assert "needs the tensorboard package" in check["detail"]


def doctor_checks(path: Path) -> dict:
    doctor = cli(path, "doctor", "--json")
    return {c["name"]: c for c in flat(json.loads(doctor.stdout))["checks"]}
