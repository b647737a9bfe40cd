# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""run.gpus on a shared box, against the test host: the run sees only its GPUs, status
names every live run's GPUs, and a deploy whose GPUs another live run of the container
holds (launched from another workdir) says which run before it stops anything."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DFLASHCTL = [sys.executable, "-m", "dflashctl"]
TRAINER = """\
import os, signal, sys, time
print("visible", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(600)
"""


def cli(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASHCTL, *args, "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


def launched(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return (done.stdout + done.stderr).split("launched run ", 1)[1].split()[0]


def log_of(container, workdir: str, run_id: str) -> str:
    path = container.host_path(f"{workdir}/runs/{run_id}/train.log")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if path.exists() and "visible" in path.read_text():
            return path.read_text()
        time.sleep(0.2)
    raise AssertionError(f"no line in {path}")


def test_gpus_per_run_on_a_shared_container(tmp_path, container, write_config, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text(TRAINER)

    def config(name: str, gpus: list[int]) -> Path:
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        return write_config(
            folder,
            trainer_source=source,
            **{
                "trainer.entry": "train.py",
                "trainer.args": [],
                "container.workdir": f"/root/{name}",
                "run.gpus": gpus,
                "run.stop_grace_s": 2,
            },
        )

    first = config("a", [0, 1])
    run_a = launched(cli(first, "deploy", "--detach"))
    assert "visible 0,1" in log_of(container, "/root/a", run_a)

    clash = config("b", [1])
    refused = cli(clash, "deploy", "--detach")
    assert refused.returncode == 3, refused.stdout + refused.stderr
    said = refused.stdout + refused.stderr
    assert "GPU 1 of CT 200" in said and f"held by run {run_a} (workdir /root/a" in said
    assert "nothing was stopped" in said
    assert not container.host_path("/root/b/runs").exists() or not any(
        container.host_path("/root/b/runs").iterdir()
    )
    assert any("/root/a/" in line for _, line in container.ps())  # run a goes on

    beside = config("b", [2])
    run_b = launched(cli(beside, "deploy", "--detach"))
    assert "visible 2" in log_of(container, "/root/b", run_b)
    status = cli(first, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    shown = " ".join(status.stdout.split())
    assert f"GPU 0,1 held by run {run_a}" in shown
    assert f"GPU 2 held by run {run_b}" in shown
