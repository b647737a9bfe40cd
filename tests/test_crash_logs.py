"""Every log under tests/data/logs with a sidecar .expected.json is classified as stated.

The sidecar holds {"exit_code": int|null, "crashes": [{"category": ..., "thread": ...,
...}, ...]} (root cause first; every key given must match, the number of crashes too),
or the short form {"category": ..., "thread": ..., "device": ...} for a log whose root
cause is all that matters (e.g. a GPU log added by hand: gpu-cudagraph-tls-*.log).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflashctl.crash import CrashDetector, classify_text, load_rules
from tests.crash_support import REQUIRED_CATEGORIES

LOG_DIR = Path(__file__).parent / "data" / "logs"
LOGS = sorted(
    p
    for p in LOG_DIR.glob("*.log")
    if p.with_suffix(".expected.json").exists()
    # The bundled trainer's own corpus (tests/data/trainer_logs.py) is scored by
    # tests/test_crash_corpus.py: root cause, rank, node and consequences.
    and "root_cause" not in json.loads(p.with_suffix(".expected.json").read_text())
)


def _expected(log: Path) -> tuple[int | None, list[dict], bool]:
    data = json.loads(log.with_suffix(".expected.json").read_text())
    if "crashes" in data:
        return data.get("exit_code"), data["crashes"], True
    root = {k: v for k, v in data.items() if k != "exit_code"}
    return data.get("exit_code"), [root], False


def test_the_log_collection_covers_every_required_category():
    categories = set()
    for log in LOGS:
        categories |= {c["category"] for c in _expected(log)[1]}
    assert REQUIRED_CATEGORIES <= categories
    assert any(not _expected(log)[1] for log in LOGS), "a clean log is part of the collection"


@pytest.mark.parametrize("log", LOGS, ids=[p.stem for p in LOGS])
def test_log_is_classified_as_expected(log: Path):
    exit_code, expected, complete = _expected(log)
    with log.open(encoding="utf-8", errors="replace") as lines:
        crashes = classify_text(lines, exit_code, load_rules())
    found = [event.to_json() for event in crashes]
    if complete:
        assert len(found) == len(expected), json.dumps(found, indent=1)[:3000]
    else:
        assert found, f"{log.name}: no crash found"
    for want, got in zip(expected, found, strict=False):
        for key, value in want.items():
            assert got[key] == value, f"{log.name}: {key}: {got[key]!r} != {value!r} in {got}"
    if found:
        assert found[0]["root_cause"] and not any(c["root_cause"] for c in found[1:])
        # The root cause first (not always the first in the log: see crash/ordering.py),
        # the consequences in log order.
        assert [c["line"] for c in found[1:]] == sorted(c["line"] for c in found[1:])


@pytest.mark.parametrize("log", LOGS, ids=[p.stem for p in LOGS])
def test_streaming_gives_the_same_crashes_as_the_whole_file(log: Path):
    """The follower feeds lines as they arrive; the events it sees equal the final list."""
    exit_code, _, _ = _expected(log)
    detector = CrashDetector(load_rules())
    seen = []
    with log.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            seen += detector.feed(line)
    seen += detector.finish(exit_code)
    assert sorted(e.line for e in seen) == sorted(e.line for e in detector.crashes)
    assert len({id(e) for e in seen}) == len(seen)
