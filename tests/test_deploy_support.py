"""Shared by the deploy, runs and stop tests: a tiny fake trainer and a local project.

The fake trainer behaves as its arguments say, so one tree covers every ending:
    --steps N        print N step lines, 0.05 s apart, then `training complete`
    --sleep S        then sleep S seconds
    --exit N         then exit with status N
    --kill SIG       then kill itself with signal SIG
    --on-term MODE   on SIGTERM: `checkpoint` writes DFLASH_RUN_DIR/checkpointed and
                     exits 0 (after as many seconds as the workdir's file slow_stop
                     says, when there is one: a big checkpoint); `ignore` ignores it
                     (only SIGKILL ends the run)
    --workers N      fork N worker processes first (same command line, like data
                     loader workers); their pids go to the file named by --workers-file
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflashctl.config.schema import load_config

FAKE_TRAINER = r"""
import os, signal, sys, time

def arg(name, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default

mode = arg("--on-term")
if mode == "checkpoint":
    def on_term(*_):
        print("SIGTERM: writing a checkpoint", flush=True)
        slow = os.path.join(os.environ["DFLASH_RUN_DIR"], "..", "..", "slow_stop")
        time.sleep(float(open(slow).read()) if os.path.exists(slow) else 0.2)
        with open(os.path.join(os.environ["DFLASH_RUN_DIR"], "checkpointed"), "w") as f:
            f.write("yes\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
elif mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

workers = []
for _ in range(int(arg("--workers", "0"))):
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(120)
        os._exit(0)
    workers.append(child)
if workers:
    with open(arg("--workers-file"), "w") as f:
        f.write(" ".join(map(str, workers)))

from helpers import greeting
print(greeting(), os.environ.get("DFLASH_RUN_ID"), os.getcwd(), flush=True)
steps = int(arg("--steps", "0"))
for i in range(steps):
    print(f"step {i + 1}/{steps} | loss 2.0 | acc 0.5", flush=True)
    time.sleep(0.05)
if steps:
    print("training complete", flush=True)
time.sleep(float(arg("--sleep", "0")))
if arg("--kill"):
    os.kill(os.getpid(), getattr(signal, arg("--kill")))
sys.exit(int(arg("--exit", "0")))
"""


def write_trainer(source: Path, *, extra_files: int = 0) -> Path:
    source.mkdir(parents=True, exist_ok=True)
    (source / "train.py").write_text(FAKE_TRAINER)
    (source / "helpers.py").write_text("def greeting():\n    return 'hello from the trainer'\n")
    (source / "configs").mkdir(exist_ok=True)
    (source / "configs" / "tiny.yaml").write_text("steps: 3\n")
    (source / "__pycache__").mkdir(exist_ok=True)
    (source / "__pycache__" / "junk.pyc").write_bytes(b"\0junk")
    for i in range(extra_files):
        (source / "pkg").mkdir(exist_ok=True)
        (source / "pkg" / f"mod_{i:02d}.py").write_text(f"VALUE = {i}\n" + "# filler\n" * 40)
    return source


def write_local_config(project: Path, *, args: list[str] | None = None, **run) -> Path:
    """A dflash.yaml for the local target (no SSH, no container) in `project`."""
    config = {
        "host": {"address": "local"},
        "container": {"vmid": None, "workdir": str(project / "workdir"), "python": sys.executable},
        "trainer": {
            "source": "src",
            "entry": "train.py",
            "args": args if args is not None else ["--sleep", "60", "--on-term", "checkpoint"],
        },
        "run": {"stop_grace_s": run.get("stop_grace_s", 3), "keep_releases": run.get("keep", 2)},
    }
    path = project / "dflash.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class LocalProject:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.source = write_trainer(root / "src")
        self.config_path = write_local_config(root)
        self.workdir = root / "workdir"

    def config(self, **overrides):
        config = load_config(self.config_path)
        for key, value in overrides.items():
            section, name = key.split("__")
            setattr(getattr(config, section), name, value)
        return config

    def run_dir(self, run_id: str) -> Path:
        return self.workdir / "runs" / run_id

    def current(self) -> Path:
        return (self.workdir / "current").resolve()


def release_manifest(release: Path) -> dict[str, list]:
    """dflashctl's manifest of a release, kept beside it (releases/<id>.manifest.json)."""
    return json.loads(Path(f"{release}.manifest.json").read_text())["manifest"]


def snapshot(root: Path) -> dict[str, object]:
    """Every path under root with its bytes (files) or link target (symlinks)."""
    found: dict[str, object] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_file():
                found[rel] = ("file", path.read_bytes())
            else:
                found[rel] = ("dir",)
    return found


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def kill_runs(workdir: Path) -> None:
    """Kill every run group still alive under workdir (test cleanup)."""
    runs = workdir / "runs"
    if not runs.is_dir():
        return
    for run in runs.iterdir():
        try:
            pid = int((run / "pid").read_text())
        except (OSError, ValueError):
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"DFLASH_RUN_ID={run.name}".encode() not in environ.split(b"\0"):
            continue  # the pid was recycled: not ours
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture
def project(tmp_path, monkeypatch):
    # What this "machine" deployed last is remembered here, not in the real ~/.cache.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    proj = LocalProject(tmp_path / "project")
    yield proj
    kill_runs(proj.workdir)
