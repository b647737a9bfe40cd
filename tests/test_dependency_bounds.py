"""The declared minimum versions are ones that work, and CI tests them (make test-min)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pins() -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "min_pins.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(line.split("==") for line in out.split())


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_every_dependency_declares_a_minimum_that_was_tested():
    found = pins()
    assert set(found) == {
        "typer",
        "rich",
        "paramiko",
        "proxmoxer",
        "pyyaml",
        "requests",
        "pydantic",
        "platformdirs",
        "pathspec",
    }
    # Below these the CLI breaks (typer 0.12: `str | None`, --version; proxmoxer < 2.3:
    # every pvesh call fails).
    assert version_tuple(found["typer"]) >= (0, 13)
    assert version_tuple(found["proxmoxer"]) >= (2, 3)


def test_ci_runs_the_readme_test_command_then_the_minimum_tier():
    run = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test\nmake test-min$", run, re.M)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test-min:", makefile, re.M)
    listed = re.search(r"^MIN_TESTS \?=(.*?)\n\n", makefile, re.S | re.M).group(1)
    for name in re.findall(r"tests/\S+\.py", listed):
        assert (ROOT / name).is_file(), name
