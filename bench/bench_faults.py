"""Faulted 2-node deploys, counted: after each fault, is the outcome all-or-nothing
(every node runs the new run, or every node still runs the old one), with one complete
`current` everywhere, and does the next plain deploy repair it? Goal: 0 bad in >= 40.

Two real containers behind two test hosts (as tests/test_nodes_faults.py, whose
harness tests/fault_support.py this uses), a light 2-node torchrun job. The kinds,
interleaved so that any --trials covers them all:

    sigkill-random     SIGKILL of the CLI at a random moment of the deploy
    sigkill-built      ... once the release is built on both nodes, before any launch
    sigkill-launch-a   ... once the launch began on gpu-a
    sigkill-launched-a ... once gpu-a's new run started
    ctrl-c-launch-a    Ctrl-C (SIGINT to the CLI's group) once the launch began on gpu-a
    ctrl-c-random      Ctrl-C at a random moment
    sshd-b-build       gpu-b's sshd dies while gpu-b builds
    sshd-b-launch      gpu-b's sshd dies once the launch began on gpu-a
    unreachable-b      gpu-b's sshd is down before the deploy
    full-disk-b        gpu-b's workdir filesystem is full (then `stop` must stop)

    .venv/bin/python bench/bench_faults.py --trials 40      # needs root, like the tests
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import fault_support as fs  # noqa: E402
from tests import full_disk  # noqa: E402

KINDS = (
    "sigkill-random",
    "sigkill-built",
    "sigkill-launch-a",
    "sigkill-launched-a",
    "ctrl-c-launch-a",
    "sshd-b-build",
    "sshd-b-launch",
    "unreachable-b",
    "full-disk-b",
    "ctrl-c-random",
)
MOMENT = {
    "sigkill-built": "built on both, before any launch",
    "sigkill-launch-a": "launch began on gpu-a",
    "sigkill-launched-a": "launched on gpu-a",
    "ctrl-c-launch-a": "launch began on gpu-a",
    "sshd-b-build": "building on gpu-b",
    "sshd-b-launch": "launch began on gpu-a",
}
# pytest imports this file again as a module of its own: the count travels in the
# environment.
TRIALS_ENV = "BENCH_FAULT_TRIALS"


def one_trial(pair: fs.Pair, kind: str, deploy_s: float) -> tuple[bool, str]:
    """(good, what was wrong): the fault, the outcome, then the repair."""
    old = fs.old_runs_everywhere(pair)
    moment = fs.moments(pair)[MOMENT[kind]] if kind in MOMENT else None
    problems = []
    if kind.startswith("sigkill"):
        fault = fs.Trial.sigkill
    elif kind.startswith("ctrl-c"):
        fault = fs.Trial.ctrl_c
    elif kind.startswith("sshd"):
        fault = lambda t: pair.b.host.crash()  # noqa: E731
    else:
        fault = lambda t: None  # noqa: E731
    if kind == "unreachable-b":
        pair.b.host.crash()
    if kind == "full-disk-b":
        # A rank still starting would die of the full disk by itself (its first print
        # fails): not the deploy's doing, so the old run has said its line first.
        fs.wait_until(lambda: fs.joined(pair, old), 180, "the old run's ranks to join")
        fs.fill_workdir(pair.b)
    random_s = deploy_s if kind.endswith("random") else 0.0
    trial, code, outcome = fs.strike(pair, moment, fault, random_s=random_s)
    said = trial.out + trial.err
    if moment is not None and not trial.hit:
        problems.append(f"(the deploy ended before {moment.name!r})")
    if not outcome.good:
        problems.append(f"{outcome.detail} [left: {fs.new_runs_left(trial)}]")
    if kind.startswith("ctrl-c") and trial.hit and (code != 130 or "Traceback" in trial.err):
        problems.append(f"Ctrl-C: exit {code}, stderr tail {trial.err[-400:]!r}")
    if kind in ("unreachable-b", "full-disk-b", "sshd-b-build") and (
        code == 0 or "gpu-b" not in said
    ):
        if outcome.which != "new":
            problems.append(f"exit {code}, and the error must name gpu-b: {said[-400:]!r}")
    if kind in ("unreachable-b", "full-disk-b") and outcome.which != "old":
        problems.append(f"refused deploy changed runs: {outcome.detail}")
    if kind == "full-disk-b":
        stopped = pair.cli("stop", timeout=180)
        left = [s.describe() for s in pair.states() if s.running]
        if stopped.returncode != 0 or left:
            problems.append(
                f"stop on a full disk: exit {stopped.returncode}, left {left}: {stopped.stderr[-300:]!r}"
            )
        fs.free_workdir(pair.b)
    if not pair.b.host.is_up:
        pair.b.host.restart()
    try:
        fs.deploy_ok(pair)
    except AssertionError as exc:
        problems.append(f"the next deploy did not repair it: {str(exc)[-600:]}")
    # Bad outcomes only: an aimed moment the deploy never reached is said, not counted.
    bad = [p for p in problems if not p.startswith("(")]
    return not bad, "; ".join(problems)


def test_faulted_deploys(pve_host, pve_host2, shared_known_hosts, tmp_path_factory):
    pair = fs.make_pair(tmp_path_factory.mktemp("bench-faults"), pve_host, pve_host2, shared_known_hosts,
                        small_disk_on_b=True)  # fmt: skip
    results: dict[str, list[tuple[bool, str]]] = defaultdict(list)
    try:
        fs.old_runs_everywhere(pair)
        pair.new_source()
        t0 = time.monotonic()
        fs.deploy_ok(pair)
        deploy_s = time.monotonic() - t0  # a whole deploy: the range of the random moments
        print(f"\na plain 2-node deploy took {deploy_s:.1f} s (random moments fall within it)")
        for number in range(int(os.environ.get(TRIALS_ENV, "40"))):
            kind = KINDS[number % len(KINDS)]
            started = time.monotonic()
            try:
                good, detail = one_trial(pair, kind, deploy_s)
            except Exception as exc:  # noqa: BLE001 - the harness failing is said, and counted bad
                good, detail = False, f"harness: {type(exc).__name__}: {exc}"
                for node in pair.nodes:
                    if not node.host.is_up:
                        node.host.restart()
                    full_disk.empty(node.view)
            results[kind].append((good, detail))
            mark = "good" if good else "BAD"
            print(
                f"trial {number + 1:2d} {kind:18s} {mark:4s} {time.monotonic() - started:5.1f} s  {detail[:300]}"
            )
    finally:
        fs.close_pair(pair)
    print(f"\n{'kind':18s} {'trials':>6s} {'good':>5s} {'bad':>4s}")
    for kind in KINDS:
        rows = results.get(kind, [])
        good = sum(1 for ok, _ in rows if ok)
        print(f"{kind:18s} {len(rows):6d} {good:5d} {len(rows) - good:4d}")
    total = sum(len(r) for r in results.values())
    bad = sum(1 for rows in results.values() for ok, _ in rows if not ok)
    print(f"{'all':18s} {total:6d} {total - bad:5d} {bad:4d}   (goal: 0 bad in >= 40)")
    for kind, rows in results.items():
        for ok, detail in rows:
            if not ok:
                print(f"BAD {kind}: {detail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args()
    os.environ[TRIALS_ENV] = str(args.trials)
    return pytest.main(
        [__file__, "-q", "-s", "-p", "no:cacheprovider", "-p", "tests.host.fixtures",
         "--rootdir", str(ROOT), "-o", "timeout=0"]
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
