"""One deploy at a time per workdir: a second is refused at once (exit 3) naming the
holder; with --wait it queues behind it. The first deploy is held in its stop step
by a run that ignores SIGTERM, so nothing here depends on timing."""

# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from dflashctl.ops.deploy import DeployOptions, deploy
from tests.json_answers import flat, one_node
from tests.test_deploy_support import project, wait_for, write_local_config  # noqa: F401

DFLASHCTL = [sys.executable, "-m", "dflashctl"]


def blocked_lock_waiters(lock: Path) -> int:
    """How many processes wait for `lock` (the kernel lists them in /proc/locks)."""
    inode = os.stat(lock).st_ino
    return sum(
        1
        for line in Path("/proc/locks").read_text().splitlines()
        if "->" in line and any(field.endswith(f":{inode}") for field in line.split())
    )


def test_a_second_deploy_is_refused_naming_the_holder_and_wait_queues(project):
    write_local_config(project.root, args=["--sleep", "60", "--on-term", "ignore"])
    code, first = deploy(project.config(), DeployOptions(detach=True))
    assert code == 0
    first = one_node(first)
    wait_for(lambda: "hello" in (project.run_dir(first["run_id"]) / "train.log").read_text())
    write_local_config(project.root, args=["--sleep", "60"], stop_grace_s=120)

    # The second deploy stops the first run, which ignores SIGTERM: it holds the lock.
    done: dict = {}
    holder = threading.Thread(
        target=lambda: done.update(r=deploy(project.config(), DeployOptions(detach=True)))
    )
    holder.start()
    try:
        stopped = project.run_dir(first["run_id"]) / "stopped.json"
        wait_for(stopped.exists, what="the stop to begin")

        refused = subprocess.run(
            [*DFLASHCTL, "deploy", "--detach", "--json"],
            cwd=project.root,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 3, refused.stderr
        said = refused.stderr
        assert (
            f"another dflashctl deploy (machine {socket.gethostname()}, pid {os.getpid()}" in said
        )
        assert "since 20" in said and "--wait" in said

        queued = subprocess.Popen(
            [*DFLASHCTL, "deploy", "--detach", "--wait", "--json"],
            cwd=project.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        lock = project.workdir / ".lock"
        wait_for(lambda: blocked_lock_waiters(lock) == 1, timeout=60, what="the queued deploy")
        os.killpg(first["pid"], signal.SIGKILL)  # the holder's stop now ends
        out, err = queued.communicate(timeout=120)
    finally:
        holder.join(timeout=120)
    code, second = done["r"]
    assert code == 0
    assert queued.returncode == 0, err
    third = flat(json.loads(out))
    assert [s["run_id"] for s in third["runs_stopped"]] == [second["run_id"]]


def test_json_errors_are_one_object_on_stdout(project, tmp_path):
    """deploy, status and logs with --json answer a failure on stdout too."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("host: {address: local}\ncontainer: {workdir: 12\n")
    for argv in (
        ["deploy", "--json", "-c", str(bad)],
        ["status", "--json", "-c", str(bad)],
        ["logs", "--json", "-c", str(bad)],
        ["logs", "no-such-run", "--json"],
        ["restart", "--json"],
    ):
        done = subprocess.run(
            [*DFLASHCTL, *argv], cwd=project.root, capture_output=True, text=True, timeout=60
        )
        assert done.returncode in (2, 3), (argv, done.stderr)
        answer = flat(json.loads(done.stdout))
        assert answer["exit_code"] == done.returncode, argv
        assert answer["error"] and "hint" in answer, argv
