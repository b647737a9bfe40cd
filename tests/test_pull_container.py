# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""pull against the test host: a run's checkpoint, its drafter/ export and its
metrics copied here from a real container, checked by sha256, resumed after a cut,
and from the node that wrote them when a run spans two nodes."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.host.fixtures import build_config
from tests.json_answers import flat
from tests.setup_support import CHECKPOINT_TRAINER

pytestmark = pytest.mark.slow

WORKDIR = "/root/dflash"
DFLASHCTL = [sys.executable, "-m", "dflashctl"]


def cli(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASHCTL, *args[:1], "-c", str(path), *args[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def finished(tmp_path, container, write_config, monkeypatch):
    """(config path, run id, container): a run that wrote checkpoints at steps 1 and 2."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text(CHECKPOINT_TRAINER)
    path = write_config(
        tmp_path, trainer_source=source, **{"trainer.entry": "train.py", "trainer.args": []}
    )
    done = cli(path, "deploy", "--detach")
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = (done.stdout + done.stderr).split("launched run ", 1)[1].split()[0]
    exit_code = container.host_path(f"{WORKDIR}/runs/{run_id}/exit_code")
    deadline = time.monotonic() + 60
    while not exit_code.exists():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return path, run_id, container


def remote(container, run_id: str, rel: str) -> Path:
    return container.host_path(f"{WORKDIR}/runs/{run_id}/{rel}")


def test_pull_copies_the_latest_checkpoint_export_and_metrics(finished, tmp_path):
    path, run_id, container = finished
    dest = tmp_path / "pulled"
    done = cli(path, "pull", run_id, "--to", str(dest), "--json")
    assert done.returncode == 0, done.stderr
    summary = flat(json.loads(done.stdout))
    ckpt = dest / "checkpoints" / "step-000002"
    for rel in ("state.pt", "drafter/config.json", "drafter/model.safetensors"):
        there = remote(container, run_id, f"outputs/checkpoints/step-000002/{rel}")
        assert sha(ckpt / rel) == sha(there)
    assert summary["export"] == str(ckpt / "drafter")
    assert summary["checkpoint"]["step"] == 2
    assert (dest / "metrics.jsonl").read_text() == remote(
        container, run_id, "metrics.jsonl"
    ).read_text()
    assert json.loads((dest / "meta.json").read_text())["run_id"] == run_id
    assert not (dest / "checkpoints" / "step-000001").exists()
    assert not list(dest.rglob("*.partial"))
    # again: nothing moves, everything is checked
    again = cli(path, "pull", run_id, "--to", str(dest), "--json")
    assert flat(json.loads(again.stdout))["already"] == len(summary["files"])
    assert flat(json.loads(again.stdout))["bytes"] == 0


def test_a_file_here_of_the_right_size_but_other_bytes_is_fetched_again(finished, tmp_path):
    """A file already here at its listed size is only hashed there; one whose bytes
    differ is fetched again, and the JSON names each file's sha256 as it is there."""
    path, run_id, container = finished
    dest = tmp_path / "pulled"
    assert cli(path, "pull", run_id, "--to", str(dest)).returncode == 0
    state = dest / "checkpoints" / "step-000002" / "state.pt"
    state.write_bytes(b"\0" * state.stat().st_size)
    again = cli(path, "pull", run_id, "--to", str(dest), "--json")
    assert again.returncode == 0, again.stderr
    summary = flat(json.loads(again.stdout))
    there = remote(container, run_id, "outputs/checkpoints/step-000002/state.pt")
    assert (summary["fetched"], summary["bytes"]) == (1, there.stat().st_size)
    assert summary["already"] == len(summary["files"]) - 1
    assert sha(state) == sha(there)
    for f in summary["files"]:
        assert f["sha256"] == sha(dest / f["path"])


def test_pull_a_step_and_the_default_folder(finished, tmp_path):
    path, run_id, container = finished
    done = subprocess.run(
        [*DFLASHCTL, "pull", run_id, "--step", "1", "-c", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    ckpt = tmp_path / "runs" / run_id / "checkpoints" / "step-000001"
    there = remote(container, run_id, "outputs/checkpoints/step-000001/state.pt")
    assert sha(ckpt / "state.pt") == sha(there)
    assert "serving export" in done.stderr + done.stdout


def test_pull_resumes_partial_files_and_verifies_them(finished, tmp_path):
    path, run_id, container = finished
    dest = tmp_path / "pulled"
    ckpt = dest / "checkpoints" / "step-000002"
    (ckpt / "drafter").mkdir(parents=True)
    state = remote(container, run_id, "outputs/checkpoints/step-000002/state.pt").read_bytes()
    model = remote(container, run_id, "outputs/checkpoints/step-000002/drafter/model.safetensors")
    # a cut pull: the first 100 KB of one file arrived, and a wrong prefix of another
    (ckpt / "state.pt.partial").write_bytes(state[:100_000])
    (ckpt / "drafter" / "model.safetensors.partial").write_bytes(b"\0" * 50_000)
    done = cli(path, "pull", run_id, "--to", str(dest), "--json")
    assert done.returncode == 0, done.stderr
    summary = flat(json.loads(done.stdout))
    # the wrong prefix, fetched again whole, counts as fetched (ops/pull.py)
    assert summary["resumed"] == 1
    assert (ckpt / "state.pt").read_bytes() == state
    assert sha(ckpt / "drafter" / "model.safetensors") == sha(model)
    # the right prefix continued from its size; the wrong one was fetched again whole
    resumed = ("state.pt", "model.safetensors")
    others = sum(f["size"] for f in summary["files"] if not f["path"].endswith(resumed))
    size = model.stat().st_size
    assert summary["bytes"] == (len(state) - 100_000) + (size - 50_000) + size + others
    assert not list(dest.rglob("*.partial"))


def test_pull_errors(finished, tmp_path):
    path, run_id, _ = finished
    unknown = cli(path, "pull", "20990101-000000-beef", "--to", str(tmp_path / "x"))
    assert unknown.returncode == 2
    assert "no run 20990101-000000-beef" in unknown.stderr and run_id in unknown.stderr
    missing = cli(path, "pull", run_id, "--step", "9", "--to", str(tmp_path / "x"))
    assert missing.returncode == 2
    assert "no checkpoint at step 9 (its checkpoints: 1, 2)" in missing.stderr
    bad = cli(path, "pull", run_id, "--step", "-3")
    assert bad.returncode == 2
    for done in (unknown, missing, bad):
        assert "Traceback" not in done.stderr


def test_pull_continues_after_it_was_cut(finished, tmp_path):
    path, run_id, container = finished
    big = remote(container, run_id, "outputs/checkpoints/step-000002/big.bin")
    with big.open("wb") as f:
        for _ in range(96):
            f.write(os.urandom(1 << 20))
    dest = tmp_path / "pulled"
    partial = dest / "checkpoints" / "step-000002" / "big.bin.partial"
    proc = subprocess.Popen(
        [*DFLASHCTL, "pull", run_id, "--to", str(dest), "-c", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while proc.poll() is None and not (partial.exists() and partial.stat().st_size > 0):
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)  # the laptop lid closes mid-transfer
    finally:
        proc.wait()
    cut_at = partial.stat().st_size if partial.exists() else None
    assert cut_at is not None and 0 < cut_at < big.stat().st_size, "the pull was not cut"
    done = cli(path, "pull", run_id, "--to", str(dest), "--json")
    assert done.returncode == 0, done.stderr
    summary = flat(json.loads(done.stdout))
    assert summary["resumed"] >= 1
    assert sha(dest / "checkpoints" / "step-000002" / "big.bin") == sha(big)
    assert not partial.exists()


def test_pull_across_nodes_takes_the_checkpoint_of_rank_0s_node(
    tmp_path, pve_host, pve_host2, shared_known_hosts, make_container, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a = make_container(200)
    b = make_container(201, host=pve_host2)
    config = build_config(pve_host, vmid=None)
    config["host"] = {
        "user": pve_host.user,
        "identity_file": str(pve_host.identity_file),
        "known_hosts": str(shared_known_hosts),
    }
    del config["proxmox"]
    config["nodes"] = [
        {
            "name": name,
            "host": {"address": host.address, "port": host.port},
            "proxmox": {"node": host.node},
            "container": {"vmid": ct.vmid},
        }
        for name, host, ct in (("gpu-a", pve_host, a), ("gpu-b", pve_host2, b))
    ]
    path = tmp_path / "dflash.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    run_id = "20261201-120000-abcd"
    # rank 0 (gpu-a) wrote step 3 and the metrics; gpu-b holds an older step 5 of its own
    for ct, step, metrics in ((a, 3, True), (b, 5, False)):
        run = ct.host_path(f"{WORKDIR}/runs/{run_id}")
        folder = run / "outputs" / "checkpoints" / f"step-{step:06d}"
        (folder / "drafter").mkdir(parents=True)
        (folder / "state.pt").write_bytes(f"state of {ct.vmid}".encode())
        (folder / "drafter" / "config.json").write_text("{}")
        (folder.parent / "latest").write_text(folder.name + "\n")
        if metrics:
            (run / "metrics.jsonl").write_text('{"step": 3, "loss": 0.5}\n')
    dest = tmp_path / "pulled"
    done = cli(path, "pull", run_id, "--to", str(dest), "--json")
    assert done.returncode == 0, done.stderr
    assert (dest / "checkpoints" / "step-000003" / "state.pt").read_text() == "state of 200"
    assert not (dest / "checkpoints" / "step-000005").exists()
    assert (dest / "metrics.jsonl").read_text() == '{"step": 3, "loss": 0.5}\n'
    # exec reaches the node it is asked for
    there = cli(path, "exec", "--node", "gpu-b", "--", "ls", f"runs/{run_id}/outputs/checkpoints")
    assert there.returncode == 0 and "step-000005" in there.stdout
    first = cli(path, "exec", "--node", "0", "--", "ls", f"runs/{run_id}/outputs/checkpoints")
    assert first.returncode == 0 and "step-000003" in first.stdout


def test_pull_keeps_modes_never_follows_links_and_brings_every_tracker(finished, tmp_path):
    path, run_id, container = finished
    ckpt = remote(container, run_id, "outputs/checkpoints/step-000002")
    private = ckpt / "optimizer-private.bin"
    private.write_bytes(b"only root may read this")
    private.chmod(0o600)
    (ckpt / "run.sh").write_text("#!/bin/sh\n")
    (ckpt / "run.sh").chmod(0o750)
    secret = container.host_path("/root/private.key")
    secret.write_text("PRIVATE KEY")
    secret.chmod(0o600)
    (ckpt / "leak").symlink_to("/root/private.key")
    (ckpt / "elsewhere").symlink_to("/root")
    for rel, text in {
        "wandb/offline-run-20261204_000000-abc/run-abc.wandb": "wandb records",
        "mlruns/0/meta.yaml": "name: Default",
        "tensorboard/events.out.tfevents.1.host": "tb",
    }.items():
        remote(container, run_id, rel).parent.mkdir(parents=True, exist_ok=True)
        remote(container, run_id, rel).write_text(text)
    dest = tmp_path / "pulled"
    done = cli(path, "pull", run_id, "--to", str(dest))
    assert done.returncode == 0, done.stderr
    pulled = dest / "checkpoints" / "step-000002"
    assert (pulled / "optimizer-private.bin").stat().st_mode & 0o777 == 0o600
    assert (pulled / "run.sh").stat().st_mode & 0o777 == 0o750
    assert not (pulled / "leak").exists() and not (pulled / "elsewhere").exists()
    assert not list(dest.rglob("private.key"))
    said = " ".join((done.stdout + done.stderr).split())
    assert "links not pulled" in said
    assert "checkpoints/step-000002/leak -> /root/private.key" in said
    assert "checkpoints/step-000002/elsewhere -> /root" in said
    assert (dest / "wandb/offline-run-20261204_000000-abc/run-abc.wandb").read_text() == (
        "wandb records"
    )
    assert (dest / "mlruns/0/meta.yaml").read_text() == "name: Default"
    assert (dest / "tensorboard/events.out.tfevents.1.host").read_text() == "tb"
    assert not (dest / "tensorboard" / "tensorboard").exists()


def test_pull_says_when_a_checkpoint_has_no_serving_export(finished, tmp_path):
    path, run_id, container = finished
    export = remote(container, run_id, "outputs/checkpoints/step-000002/drafter")
    subprocess.run(["rm", "-rf", str(export)], check=True)
    done = cli(path, "pull", run_id, "--to", str(tmp_path / "pulled"))
    assert done.returncode == 0, done.stderr
    assert "no serving export in it" in done.stdout + done.stderr


def test_pull_moves_many_files_in_one_stream(finished, tmp_path):
    """One reader for the whole tree (not one pct exec per file): the command log of
    the test host's pct counts them."""
    path, run_id, container = finished
    many = remote(container, run_id, "outputs/checkpoints/step-000002/shards")
    many.mkdir()
    for i in range(300):
        (many / f"shard-{i:04d}.bin").write_bytes(os.urandom(64))
    done = subprocess.run(
        [*DFLASHCTL, "-v", "pull", run_id, "--to", str(tmp_path / "pulled"), "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    for i in (0, 299):
        name = f"shard-{i:04d}.bin"
        assert (tmp_path / "pulled/checkpoints/step-000002/shards" / name).read_bytes() == (
            many / name
        ).read_bytes()
    # Each command run is said once with -v: the plan, and one reader.
    assert done.stderr.count("pct exec") <= 4, done.stderr
