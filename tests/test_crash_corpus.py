"""The bundled trainer's real failures (tests/data/trainer_logs.py wrote them: plain,
torchrun with 2 ranks, 2 nodes; CPU, gloo) are named as `logs --file` names them: the
root cause's category, rank and node, the consequences, and no crash at all for clean
runs and clean stops. The score is printed; every log must be right."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflashctl.crash import load_rules
from dflashctl.follow import classify_log
from tests.json_answers import flat

LOG_DIR = Path(__file__).parent / "data" / "logs"
ROOT = Path(__file__).resolve().parents[1]


def _corpus() -> list[Path]:
    logs = []
    for log in sorted(LOG_DIR.glob("*.log")):
        sidecar = log.with_suffix(".expected.json")
        if sidecar.exists() and "root_cause" in json.loads(sidecar.read_text()):
            logs.append(log)
    return logs


CORPUS = _corpus()


def classify(log: Path, exit_code: int | None):
    with log.open("rb") as handle:
        return classify_log(
            iter([handle.read()]), rules=load_rules(), exit_code=exit_code, show_lines=False
        )


def score(log: Path) -> list[str]:
    """What is wrong with how `log` is named (empty: all right)."""
    want = json.loads(log.with_suffix(".expected.json").read_text())
    result = classify(log, want.get("exit_code"))
    crashes = [event.to_json() for event in result.crashes]
    wrong = []
    root = want["root_cause"]
    if root is None:
        if crashes:
            found = [(c["category"], c["rank"], c["message"]) for c in crashes]
            wrong.append(f"false alarm: {found}")
        if want.get("stopped"):
            stop = result.stop or {}
            if result.status != "stopped" or not stop.get("clean"):
                wrong.append(f"not read as a clean stop: {result.status}, {stop}")
            elif stop.get("step") is not None and stop["said"] != (
                f"stopped (checkpoint at step {stop['step']})"
            ):
                wrong.append(f"said {stop['said']!r}")
        elif result.status != "finished":
            wrong.append(f"status {result.status}")
        return wrong
    if not crashes:
        return [f"no crash found (status {result.status})"]
    first = crashes[0]
    if not first["root_cause"]:
        wrong.append("the first crash is not flagged as the root cause")
    for key, value in root.items():
        if first.get(key) != value:
            wrong.append(f"root cause {key}: {first.get(key)!r}, expected {value!r}")
    for consequence in want.get("consequences", []):
        if not any(
            all(c.get(k) == v for k, v in consequence.items()) and not c["root_cause"]
            for c in crashes[1:]
        ):
            wrong.append(
                f"consequence {consequence} missing from {[(c['category'], c['rank']) for c in crashes[1:]]}"
            )
    if want.get("detail") and want["detail"] not in first["hint"]:
        wrong.append(f"the hint does not say {want['detail']!r}: {first['hint']}")
    if result.status != want.get("status", "crashed"):
        wrong.append(f"status {result.status}, expected {want.get('status', 'crashed')}")
    return wrong


def test_the_corpus_covers_every_class():
    classes = set()
    clean = stops = 0
    for log in CORPUS:
        want = json.loads(log.with_suffix(".expected.json").read_text())
        if want["root_cause"] is None:
            clean += not want.get("stopped")
            stops += bool(want.get("stopped"))
        else:
            classes.add(want["root_cause"]["category"])
    assert {
        "killed",
        "peer_lost",
        "thread_exception",
        "gloo_timeout",
        "data_error",
        "disk_full",
        "host_memory",
        "port_in_use",
        "setup_error",
        "config_error",
        "hang",
        "code_error",
        "rendezvous",
        "interrupted",
    } <= classes
    assert clean >= 3 and stops >= 3
    assert any(".node1" in log.name for log in CORPUS), "a two-node run is part of it"


def test_the_corpus_scores_every_log_right(capsys):
    results = {log.stem: score(log) for log in CORPUS}
    right = [name for name, wrong in results.items() if not wrong]
    with capsys.disabled():
        print(f"\ncrash corpus: {len(right)}/{len(results)} logs named right")
        for name, wrong in results.items():
            for problem in wrong:
                print(f"  {name}: {problem}")
    assert len(right) == len(results), {k: v for k, v in results.items() if v}


@pytest.mark.parametrize("log", CORPUS, ids=[p.stem for p in CORPUS])
def test_streaming_names_the_same_root_cause(log: Path):
    """Line by line, as the follower feeds it: the same root cause at the end."""
    from dflashctl.crash import CrashDetector, classify_text

    want = json.loads(log.with_suffix(".expected.json").read_text())
    detector = CrashDetector(load_rules())
    for line in log.read_text(errors="replace").splitlines():
        detector.feed(line)
        detector.flush() if line.startswith("step ") else None
    detector.finish(want.get("exit_code"))
    whole = classify_text(
        log.read_text(errors="replace").splitlines(), want.get("exit_code"), load_rules()
    )
    assert [(e.category, e.rank) for e in detector.crashes] == [(e.category, e.rank) for e in whole]


def test_logs_file_json_carries_rank_node_and_host():
    """`dflashctl logs --file` on the log of a rank SIGKILLed under torchrun: the rank
    killed is the root cause, the other rank's peer_lost a consequence, as fields."""
    log = LOG_DIR / "torchrun-sigkill-rank1.log"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflashctl",
            "logs",
            "--file",
            str(log),
            "--exit-code",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT / "tests",  # no dflash.yaml there: the built-in rules
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    data = flat(json.loads(run.stdout))
    root, *rest = data["crashes"]
    assert (root["category"], root["rank"], root["local_rank"]) == ("killed", 1, 1)
    assert root["message"] == "rank 1 killed (SIGKILL)" and root["root_cause"]
    assert root["pid"] and root["host"]
    assert any(c["category"] == "peer_lost" and c["rank"] == 0 for c in rest)


def test_the_panel_names_the_rank():
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflashctl",
            "logs",
            "--file",
            str(LOG_DIR / "torchrun-sigkill-rank1.log"),
            "-n",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT / "tests",
        timeout=120,
        env={"COLUMNS": "120", "NO_COLOR": "1", "PATH": "/usr/bin:/bin"},
    )
    assert "rank 1 killed (SIGKILL)" in run.stdout + run.stderr
    assert re.search(r"│ rank +1 \(local rank 1\) +│", run.stdout), run.stdout
    assert re.search(r"│ rank +0 \(local rank 0\) +│", run.stdout), run.stdout
