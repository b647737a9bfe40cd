"""A run stopped while it hung keeps `hung` as its end state: `runs` and `status` say
so after `dflashctl stop`, though the stop ended it (SIGKILL after its grace period).

A real run of the supervisor on this machine (host.address: local), through `deploy`."""

from __future__ import annotations

import json

from tests.json_answers import flat
from tests.test_deploy_support import wait_for
from tests.test_recovery import cli, flaky, only_run  # noqa: F401

# Appended to the flaky trainer of tests/test_recovery.py: steps, then the trainer's
# watchdog line, then a thread that never lets the stop finish (SIGTERM taken, no exit).
HUNG = r"""
if mode == "hung":
    def on_term(signum, frame):
        print("received SIGTERM: finishing the current step, then writing a checkpoint", flush=True)
    signal.signal(signal.SIGTERM, on_term)
    for step in (5, 10):
        print(f"step {step}/400 | loss 2.0", flush=True)
    print("drafter-0 on cpu: training", flush=True)
    print("watchdog: no step finished for 64 s (threshold 60 s) after step 10; waiting: "
          "drafter-0 at train.py:9 in push; every thread's stack written to /tmp/x.json",
          flush=True)
    while True:
        time.sleep(1)
"""


def test_status_and_runs_keep_hung_after_a_stop(flaky):  # noqa: F811
    path = flaky("hung")
    train = path.parent / "src" / "train.py"
    train.write_text(train.read_text() + HUNG)
    assert cli("deploy", "-c", str(path), "--detach").returncode == 0
    run_dir = only_run(path)
    wait_for(lambda: "watchdog: " in (run_dir / "train.log").read_text(), what="the watchdog")
    stopped = cli("stop", "-c", str(path))
    assert stopped.returncode == 0, stopped.stderr
    # The stop found it hanging and said so in the run's record of the stop.
    assert "after step 10" in json.loads((run_dir / "stopped.json").read_text())["hung"]

    runs = cli("runs", "-c", str(path), "--json")
    [run] = flat(json.loads(runs.stdout))["runs"]
    assert run["category"] == "hang" and run["state"].startswith("hung (")
    assert "drafter-0 at train.py:9" in run["hung"] and "then stopped by stop" in run["state"]
    status = cli("status", "-c", str(path), "--json")
    assert '"hung (no step finished for 64 s' in status.stdout, status.stdout
    plain = cli("runs", "-c", str(path))
    assert "hung (no step finished" in " ".join(plain.stdout.split()), plain.stdout


def test_the_supervisor_records_a_hang_when_the_trainer_ends_after_a_stop():
    """The trainer that ends by itself after the stop (its stuck thread given up): the
    attempt's record keeps the hang as its category."""
    from dflashctl.agent.supervisor import _hung
    from dflashctl.crash.rules import rule_mappings

    lines = [
        "step 10/400 | loss 2.0",
        "watchdog: no step finished for 64 s (threshold 60 s) after step 10; waiting: "
        "drafter-0 at train.py:9 in push; every thread's stack written to /tmp/x.json",
        "received SIGTERM: finishing the current step, then writing a checkpoint",
        "threads still running 8 s after the stop: drafter-0; exiting",
    ]
    said = _hung(lines, 1, rule_mappings())
    assert said["category"] == "hang" and "drafter-0 stuck" in said["summary"]
    assert _hung(lines[:1], 143, rule_mappings()) == {}
