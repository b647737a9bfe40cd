"""Ctrl-C at any moment: one line, exit status 130, never a traceback.

A real `dflashctl deploy` process gets SIGINT at moments fixed by what it has done, not
by the clock: Python's `-X importtime` prints a line as each import ends, so the
signal lands right after rich, yaml, pydantic, dflashctl's config or the deploy code
were imported (the command line not yet parsed), and later while the run is followed.
"""

# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.test_deploy_support import project  # noqa: F401

IMPORTED = (
    "rich",
    "yaml",
    "pydantic",
    "dflashctl.config.schema",
    "dflashctl.cli",
    "dflashctl.ops.deploy",
)


def start(project, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH")}
    return subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "dflashctl", *args],
        cwd=project.root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env, PYTHONUNBUFFERED="1"),
    )


def imported(line: str, module: str) -> bool:
    """Is this `-X importtime` line the end of importing `module`?"""
    return line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == module


def interrupt_after(proc: subprocess.Popen, wanted) -> tuple[list[str], str]:
    """Read stderr until a line satisfies `wanted`, send SIGINT; (what it said on
    stderr, import-time lines left out; its stdout)."""
    said: list[str] = []
    for line in proc.stderr:
        if wanted(line.rstrip("\n")):
            break
        if not line.startswith("import time:"):
            said.append(line.rstrip("\n"))
    else:
        raise AssertionError(f"ended before the moment: {said}")
    proc.send_signal(signal.SIGINT)
    out, rest = proc.communicate(timeout=120)
    said += [line for line in rest.splitlines() if not line.startswith("import time:")]
    return said, out


@pytest.mark.parametrize("module", IMPORTED)
def test_ctrl_c_while_importing_is_one_line_and_exit_130(project, module):
    proc = start(project, "deploy")
    said, _ = interrupt_after(proc, lambda line: imported(line, module))
    assert proc.returncode == 130, said
    assert said == ["interrupted"]


def test_ctrl_c_while_importing_with_json_still_answers_json(project):
    proc = start(project, "status", "--json")
    said, out = interrupt_after(proc, lambda line: imported(line, "pydantic"))
    assert proc.returncode == 130
    assert said == ["interrupted"]
    assert json.loads(out) == {
        "schema_version": 1,
        "command": "status",
        "nodes": [],
        "error": "interrupted",
        "exit_code": 130,
        "hint": None,
    }


def test_ctrl_c_while_following_the_run_says_it_without_a_traceback(project):
    proc = start(project, "deploy")
    said, _ = interrupt_after(proc, lambda line: "launched run" in line)
    assert proc.returncode == 130, said
    assert not any("Traceback" in line for line in said), said
    # Caught while following, the follower says the run goes on and how to follow it
    # again; caught just before (the launch still being said), one "interrupted".
    assert any("interrupted" in line or "stopped following;" in line for line in said), said


def exists(module: str) -> bool:
    """A module that can be imported. -X importtime also times a library's probe for an
    optional module that is not installed (pathspec 1.x tries `re2` three times): that
    failed import is no moment of dflashctl's start-up."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def import_order(project) -> list[str]:
    """Every module a `deploy` imports after dflashctl.entry (whose import puts the
    handler in place), in the order their imports end, up to its first step line."""
    proc = start(project, "deploy")
    order, after_entry = [], False
    for line in proc.stderr:
        if line.startswith("import time:"):
            module = line.rsplit("|", 1)[-1].strip()
            after_entry = after_entry or module == "dflashctl.entry"
            if after_entry and module != "dflashctl.entry" and exists(module):
                order.append(module)
        elif "launched run" in line:
            break
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    return order


def test_ctrl_c_at_many_moments_is_always_one_line_and_exit_130(project):
    """Once dflashctl.entry is imported, Ctrl-C at any moment, once or twice in a row
    (a second during the report of the first), exits 130 with no traceback: right
    after each of 16 imports spread over the start-up, and while the run is followed."""
    # The order of a redeploy, as every deploy below is: the first one validates the
    # config (imports such as ssl, for verify_tls) that later ones take from the cache.
    import_order(project)
    order = import_order(project)
    assert len(order) > 16, order
    picks = [order[i * (len(order) - 1) // 15] for i in range(16)]
    failures = []
    for number, module in enumerate(picks + ["launched run"] * 4):
        twice = number % 2 == 1
        proc = start(project, "deploy")
        if module == "launched run":
            wanted = lambda line: "launched run" in line  # noqa: E731
        else:
            wanted = lambda line, m=module: imported(line, m)  # noqa: E731
        said: list[str] = []
        for line in proc.stderr:
            if wanted(line.rstrip("\n")):
                break
            if not line.startswith("import time:"):
                said.append(line.rstrip("\n"))
        proc.send_signal(signal.SIGINT)
        if twice:
            proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=120)
        said += [line for line in rest.splitlines() if not line.startswith("import time:")]
        if proc.returncode != 130 or any("Traceback" in line for line in said):
            failures.append((module, twice, proc.returncode, said[-12:]))
    assert not failures, failures


def test_python_start_up_runs_no_import_of_dflashctls_install():
    """Before dflashctl.entry runs, Ctrl-C is Python's: a KeyboardInterrupt with a
    traceback from importlib, or death by the signal. Keep that window bare: an
    editable install (`make install`) must not import a finder from its .pth file
    as every Python starts (the default editable mode does: pathlib, urllib, ...)."""
    import site

    folders = [*site.getsitepackages(), site.getusersitepackages()]
    ours = [
        path
        for folder in folders
        if os.path.isdir(folder)
        for path in (os.path.join(folder, name) for name in os.listdir(folder))
        if path.endswith(".pth") and "dflashctl" in os.path.basename(path)
    ]
    for path in ours:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
        assert not [line for line in lines if line.startswith("import")], (
            f"{path} imports at every start-up: reinstall with "
            "`pip install -e . --config-settings editable_mode=compat` (as `make install` does)"
        )
