# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
"""`logs -f` on a run that has logged nothing yet (a trainer importing torch): a live
"waiting for the first line (N s)" on a terminal, nothing off a terminal or with --json."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

from dflashctl.ops.deploy import DeployOptions, deploy
from tests.test_deploy_support import project, write_local_config  # noqa: F401

DFLASHCTL = [sys.executable, "-m", "dflashctl"]

# Logs nothing until DFLASH_RUN_DIR/go appears or --quiet-for seconds pass.
SLOW_STARTER = r"""
import os, sys, time
quiet_for = float(sys.argv[sys.argv.index("--quiet-for") + 1])
go = os.path.join(os.environ["DFLASH_RUN_DIR"], "go")
started = time.monotonic()
while not os.path.exists(go) and time.monotonic() - started < quiet_for:
    time.sleep(0.02)
print("first line", flush=True)
"""


def launch(project, quiet_for: float) -> str:
    (project.source / "train.py").write_text(SLOW_STARTER)
    write_local_config(project.root, args=["--quiet-for", str(quiet_for)])
    code, summary = deploy(project.config(), DeployOptions(detach=True))
    assert code == 0
    return summary["run_id"]


def read_until(fd: int, wanted: bytes, timeout: float) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while wanted not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {wanted!r} on the terminal; it showed {seen[-500:]!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            seen += os.read(fd, 4096)
    return seen


def test_a_terminal_shows_the_wait_live(project):
    run_id = launch(project, quiet_for=60)
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [*DFLASHCTL, "logs", "-f", "-c", str(project.config_path)],
        stdout=subprocess.PIPE,
        stderr=secondary,
        env={**os.environ, "TERM": "xterm", "COLUMNS": "80"},
    )
    os.close(secondary)
    try:
        read_until(primary, b"waiting for the first line (1 s)", timeout=30)
        read_until(primary, b"waiting for the first line (2 s)", timeout=30)  # it counts
        (project.run_dir(run_id) / "go").write_text("")
        stdout, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
        os.close(primary)
    assert proc.returncode == 0
    assert stdout.decode().splitlines()[0] == "first line"  # the notice never reaches stdout


def drain(fd: int) -> bytes:
    """What a terminal got, once the program that wrote it has ended."""
    seen = b""
    while select.select([fd], [], [], 0)[0]:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the other side is closed and everything was read
            break
        if not chunk:
            break
        seen += chunk
    return seen


def test_nothing_extra_off_a_terminal(project):
    launch(project, quiet_for=2)
    done = subprocess.run(
        [*DFLASHCTL, "logs", "-f", "-c", str(project.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TERM": "xterm"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "first line"
    assert "waiting" not in done.stdout + done.stderr


def test_nothing_extra_with_json_even_on_a_terminal(project):
    launch(project, quiet_for=2)
    primary, secondary = pty.openpty()
    try:
        done = subprocess.run(
            [*DFLASHCTL, "logs", "-f", "--json", "-c", str(project.config_path)],
            stdout=subprocess.PIPE,
            stderr=secondary,
            timeout=60,
            env={**os.environ, "TERM": "xterm", "COLUMNS": "80"},
        )
        os.close(secondary)
        terminal = drain(primary)
    finally:
        os.close(primary)
    assert done.returncode == 0
    assert b"first line" in terminal and b"waiting" not in terminal
    assert b"waiting" not in done.stdout
