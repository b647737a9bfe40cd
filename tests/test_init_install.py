"""`dflashctl init` as a `pip install` user meets it (the package alone: no templates/
or trainer/ beside it) and in a checkout: where the trainer comes from, what to set,
and a template that names only files this installation has."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def init_in(folder: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", "init"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=folder,
        env=env,
    )


def named_rules_file(text: str) -> Path:
    found = re.search(r"crash_patterns: \[\].*same form as the built-in ones: (\S+)", text)
    assert found, text
    return Path(found.group(1))


def test_init_after_a_pip_install_says_where_the_trainer_comes_from(tmp_path):
    # What a wheel installs: the package with its _templates, nothing beside it.
    site = tmp_path / "site"
    shutil.copytree(
        ROOT / "dflashctl", site / "dflashctl", ignore=shutil.ignore_patterns("__pycache__")
    )
    work = tmp_path / "work"
    work.mkdir()
    done = init_in(work, pythonpath=site)
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "this installation has no trainer of its own" in said
    assert "trainer.source" in said and "container.python" in said
    text = (work / "dflash.yaml").read_text()
    rules = named_rules_file(text)
    assert rules.is_file() and str(rules).startswith(str(site))
    assert text.count("commit_port:") == 1


def test_init_in_a_checkout_names_the_bundled_trainer(tmp_path):
    done = init_in(tmp_path)
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert f"the bundled trainer is {ROOT / 'trainer'}" in said
    assert "container.python" in said
    assert named_rules_file((tmp_path / "dflash.yaml").read_text()).is_file()
