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


# A bound on a hung program, not a speed check: `import torch` alone takes minutes on a
# machine shared with other work.
PROGRAM_TIMEOUT_S = 600


def check(scenario) -> None:
    text, exit_code = make_real_logs.run_scenario(scenario, timeout=PROGRAM_TIMEOUT_S)
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
@pytest.mark.timeout(PROGRAM_TIMEOUT_S + 120)
@pytest.mark.parametrize("scenario", WITH_TORCH, ids=[s.name for s in WITH_TORCH])
def test_real_torch_failure(scenario):
    pytest.importorskip("torch")
    check(scenario)


def test_sigkill_is_weighed_by_the_exit_status():
    text, exit_code = make_real_logs.run_scenario(make_real_logs.SIGKILL)
    assert exit_code == -9 and "Killed" not in text  # nothing in the log says so
    [event] = classify_text(text.splitlines(), exit_code, load_rules())
    assert event.category == "killed" and "SIGKILL" in event.message


def test_threads_failing_at_once_are_each_found_with_their_own_thread():
    for _ in range(3):  # the interleaving differs from run to run
        text, exit_code = make_real_logs.run_scenario(make_real_logs.CONCURRENT_THREAD_FAILURES)
        crashes = classify_text(text.splitlines(), exit_code, load_rules())
        assert sorted(e.thread for e in crashes) == [f"drafter-{i}" for i in range(4)], text
        for event in crashes:
            assert event.device == f"cuda:{event.thread[-1]}"
            assert event.stage == "warming compiled graphs"
            assert event.message == f"('graph', {event.thread[-1]})", text


def test_a_log_garbled_by_threads_failing_at_once_still_reports_a_crash():
    """CPython's excepthook wrote four headers in pieces into one another (a real log)."""
    garbled = (Path(__file__).parent / "data" / "logs" / "real-garbled-excepthook.txt").read_text()
    crashes = classify_text(garbled.splitlines(), 0, load_rules())
    assert crashes and crashes[0].is_root_cause
    assert {e.category for e in crashes} <= {"thread_exception", "python_exception"}
    assert sum(e.exception == "KeyError" for e in crashes) >= 2
