"""Real failures, produced here and now, are found with the right thread and category.

The scenarios live in tests/data/make_real_logs.py (which also wrote the committed
real-*.log files); here they run live against this Python, so a change in how CPython
or torch prints a failure shows up as a test failure.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from dflashctl.crash import classify_text, load_rules

_spec = importlib.util.spec_from_file_location(
    "make_real_logs", Path(__file__).parent / "data" / "make_real_logs.py"
)
make_real_logs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("make_real_logs", make_real_logs)  # dataclasses look their module up
_spec.loader.exec_module(make_real_logs)

QUICK = [s for s in make_real_logs.SCENARIOS if not s.needs_torch]
WITH_TORCH = [s for s in make_real_logs.SCENARIOS if s.needs_torch and s.run_in_tests]


def check(scenario) -> None:
    text, exit_code = make_real_logs.run_scenario(scenario, timeout=180)
    crashes = [e.to_json() for e in classify_text(text.splitlines(), exit_code, load_rules())]
    assert len(crashes) == len(scenario.expected), (text, crashes)
    for want, got in zip(scenario.expected, crashes, strict=True):
        for key, value in want.items():
            assert got[key] == value, (key, text, got)
    assert crashes[0]["root_cause"]


@pytest.mark.parametrize("scenario", QUICK, ids=[s.name for s in QUICK])
def test_real_failure(scenario):
    check(scenario)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", WITH_TORCH, ids=[s.name for s in WITH_TORCH])
def test_real_torch_failure(scenario):
    pytest.importorskip("torch")
    check(scenario)


def test_sigkill_is_weighed_by_the_exit_status():
    text, exit_code = make_real_logs.run_scenario(make_real_logs.SIGKILL)
    assert exit_code == -9 and "Killed" not in text  # nothing in the log says so
    [event] = classify_text(text.splitlines(), exit_code, load_rules())
    assert event.category == "killed" and "SIGKILL" in event.message
