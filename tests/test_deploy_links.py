# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""Links and modes through a real deploy to the test host's container: a link inside
trainer.source arrives as a link (to a file or a folder), one changed between deploys
is changed in the new release, one that leads out is refused naming it, and a file's
permissions come back as they were through deploy and then pull."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_deploy_container import setup  # noqa: F401  (a container, a waiting trainer)

pytestmark = pytest.mark.slow

WORKDIR = "/root/dflash"
DFLASHCTL = [sys.executable, "-m", "dflashctl"]
CLI_TIMEOUT_S = 300  # a bound on a hung command on a loaded machine, not a speed check


def cli(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASHCTL, *args[:1], "-c", str(path), *args[1:]],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def deployed(path: Path) -> str:
    """Deploy (detached); the new release's id."""
    done = cli(path, "deploy", "--detach")
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout + done.stderr
    return said.split("into release ", 1)[1].split()[0] if "into release " in said else ""


def test_links_inside_arrive_as_links_change_and_leaving_ones_are_refused(setup, tmp_path):
    path, source, container = setup
    (source / "settings").symlink_to("configs")  # a folder
    (source / "main.py").symlink_to("train.py")  # a file
    (source / "configs" / "active.yaml").symlink_to("tiny.yaml")
    first = deployed(path)
    releases = container.host_path(f"{WORKDIR}/releases")
    release = releases / first
    assert os.readlink(release / "settings") == "configs"
    assert os.readlink(release / "main.py") == "train.py"
    assert os.readlink(release / "configs" / "active.yaml") == "tiny.yaml"
    assert (release / "settings" / "tiny.yaml").read_text() == "steps: 3\n"
    assert sorted(os.listdir(release)) == [
        "configs",
        "helpers.py",
        "main.py",
        "settings",
        "train.py",
    ]
    # Through the container's own eyes too (its paths, its kernel's resolution).
    seen = container.exec(["readlink", f"{WORKDIR}/current/settings"]).stdout.strip()
    assert seen == "configs"

    (source / "configs" / "big.yaml").write_text("steps: 30\n")
    (source / "configs" / "active.yaml").unlink()
    (source / "configs" / "active.yaml").symlink_to("big.yaml")
    (source / "main.py").unlink()
    (source / "main.py").write_text("import train\n")  # a link turned file
    second = deployed(path)
    assert second and second != first
    assert os.readlink(releases / second / "configs" / "active.yaml") == "big.yaml"
    assert (releases / second / "settings" / "active.yaml").read_text() == "steps: 30\n"
    assert not (releases / second / "main.py").is_symlink()
    assert (releases / second / "main.py").read_text() == "import train\n"
    assert os.readlink(releases / first / "configs" / "active.yaml") == "tiny.yaml"

    secret = tmp_path / "id_ed25519"
    secret.write_text("PRIVATE KEY")
    (source / "configs" / "key").symlink_to(secret)
    refused = cli(path, "deploy", "--detach")
    assert refused.returncode == 2
    said = " ".join((refused.stdout + refused.stderr).split())
    assert f"configs/key -> {secret}" in said and "trainer.exclude" in said
    assert os.readlink(container.host_path(f"{WORKDIR}/current")) == f"releases/{second}"
    assert not list(releases.glob("*/configs/key"))


MODES_TRAINER = """\
import os, shutil
run = os.environ["DFLASH_RUN_DIR"]
folder = os.path.join(run, "outputs", "checkpoints", "step-000001")
os.makedirs(folder)
for name in ("secret.env", "tool.sh", "notes.txt"):
    shutil.copy2(name, folder)  # from its release, modes and all
with open(os.path.join(run, "outputs", "checkpoints", "latest"), "w") as f:
    f.write("step-000001\\n")
"""


def test_modes_survive_deploy_then_pull(tmp_path, container, write_config, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text(MODES_TRAINER)
    modes = {"secret.env": 0o600, "tool.sh": 0o750, "notes.txt": 0o644}
    for name, mode in modes.items():
        (source / name).write_text(f"{name}\n")
        (source / name).chmod(mode)
    path = write_config(
        tmp_path, trainer_source=source, **{"trainer.entry": "train.py", "trainer.args": []}
    )
    done = cli(path, "deploy", "--detach")
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = (done.stdout + done.stderr).split("launched run ", 1)[1].split()[0]
    release = container.host_path(f"{WORKDIR}/current").resolve()
    assert {n: (release / n).stat().st_mode & 0o777 for n in modes} == modes
    exit_code = container.host_path(f"{WORKDIR}/runs/{run_id}/exit_code")
    deadline = time.monotonic() + 120  # a net for a loaded machine; returns once it is there
    while not exit_code.exists():
        assert time.monotonic() < deadline, "the run never ended"
        time.sleep(0.1)
    assert exit_code.read_text().strip() == "0"
    pulled = cli(path, "pull", run_id, "--to", str(tmp_path / "pulled"))
    assert pulled.returncode == 0, pulled.stderr
    ckpt = tmp_path / "pulled" / "checkpoints" / "step-000001"
    assert {n: (ckpt / n).stat().st_mode & 0o777 for n in modes} == modes
    assert {n: (ckpt / n).read_text() for n in modes} == {n: f"{n}\n" for n in modes}
