"""Every crash loop ends: a restart that would resume from the checkpoint the last
attempt started from, after that attempt got nowhere, is not made; restarts are counted
since the last new checkpoint, so a run.retry.window_s shorter than an attempt still
ends the loop; a run that writes a new checkpoint between crashes keeps being retried.

Real runs of the supervisor on this machine (host.address: local), through `deploy`."""

from __future__ import annotations

import json

import pytest

from dflashctl.agent.supervisor import decide
from tests.test_recovery import KILLED, POLICY, cli, flaky, only_run  # noqa: F401

# Appended to the flaky trainer of tests/test_recovery.py: modes that write checkpoints.
CHECKPOINTING = r"""
def checkpoint(step):
    folder = os.path.join(os.getcwd(), "ckpt", f"step-{step:06d}")
    os.makedirs(folder, exist_ok=True)
    print(f"checkpoint: {folder} (step {step})", flush=True)
if mode == "kill-after-checkpoint":  # killed at step 203, just after the step-200 one
    if attempt == 1:
        print("step 200/400 | loss 2.0", flush=True)
        checkpoint(200)
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "progress":  # a new checkpoint each attempt, then done in attempt 4
    if attempt < 4:
        print(f"step {attempt * 100}/400 | loss 2.0", flush=True)
        checkpoint(attempt * 100)
        os.kill(os.getpid(), signal.SIGKILL)
    print("step 400/400 | loss 1.0", flush=True)
    print("training complete", flush=True)
"""


@pytest.fixture
def trainer(flaky, tmp_path):  # noqa: F811
    def write(mode, **retry):
        path = flaky(mode, **retry)
        train = tmp_path / "src" / "train.py"
        if "def checkpoint" not in train.read_text():
            train.write_text(train.read_text() + CHECKPOINTING)
        return path

    return write


def attempts_of(path):
    return json.loads((only_run(path) / "attempts.json").read_text())["attempts"]


def test_killed_after_the_same_checkpoint_every_time_is_retried_once(trainer):
    path = trainer("kill-after-checkpoint")
    done = cli("deploy", "-c", str(path))
    assert done.returncode == 1, done.stdout + done.stderr
    attempts = attempts_of(path)
    assert [a["retried"] for a in attempts] == [True, False]
    assert attempts[1]["resumed_from"].endswith("ckpt/step-000200")
    assert attempts[1]["checkpointed"] is False
    reason = attempts[1]["reason"]
    assert reason.startswith("it resumed from checkpoint ")
    assert "made no progress past it (no new checkpoint, no step logged after the resume)" in (
        reason
    )
    assert "not retried: it resumed from checkpoint" in done.stderr


def test_a_window_shorter_than_an_attempt_still_ends_the_loop(trainer):
    # Each attempt logs a step further (so it is not the same crash), but none writes a
    # checkpoint; every restart is older than the window by the time of the next crash.
    path = trainer("loop", max_restarts=2, window_s=0.001)
    done = cli("deploy", "-c", str(path))
    assert done.returncode == 1, done.stdout + done.stderr
    attempts = attempts_of(path)
    assert [a["retried"] for a in attempts] == [True, True, False]
    assert attempts[-1]["reason"] == (
        "2 restarts since the last new checkpoint already (run.retry.max_restarts 2, "
        "whatever run.retry.window_s): a crash loop"
    )


def test_a_run_that_makes_progress_between_crashes_is_retried_to_its_end(trainer):
    path = trainer("progress", max_restarts=3, window_s=0.001)
    done = cli("deploy", "-c", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    attempts = attempts_of(path)
    assert [a["retried"] for a in attempts] == [True, True, True, False]
    assert [a["checkpointed"] for a in attempts[:3]] == [True, True, True]
    assert [a["resumed_from"] and a["resumed_from"][-6:] for a in attempts] == [
        None, "000100", "000200", "000300"
    ]  # fmt: skip
    assert attempts[-1]["reason"] == "finished"


def record(number, *, step, resumed_from=None, checkpointed=False, ended=1000.0):
    return {
        "attempt": number,
        "step": step,
        "retried": True,
        "ended_unix": ended,
        "resumed_from": resumed_from,
        "checkpointed": checkpointed,
    }


def test_the_rules_that_end_a_loop():
    ckpt = "/w/runs/r/ckpt/step-000200"
    first = record(1, step=200, checkpointed=True)
    # Resumed at 200, nothing logged, nothing written: the same crash.
    retry, reason = decide(
        POLICY, [first], KILLED, None, 1000.0, record(2, step=None, resumed_from=ckpt)
    )
    assert not retry and "made no progress past it" in reason
    # Logged less far than the attempt before: no progress either.
    assert not decide(POLICY, [first], KILLED, 150, 1000.0, record(2, step=150, resumed_from=ckpt))[
        0
    ]
    # Got further than the attempt before: retried.
    assert decide(POLICY, [first], KILLED, 260, 1000.0, record(2, step=260, resumed_from=ckpt))[0]
    # The first attempt gets its one retry, whatever it did.
    assert decide(POLICY, [], KILLED, None, 1000.0, record(1, step=None))[0]
    # Outside the window, still counted since the last new checkpoint.
    stalled = [first] + [record(i, step=200 + i, resumed_from=ckpt) for i in (2, 3, 4)]
    retry, reason = decide(
        POLICY, stalled, KILLED, 210, 99999.0, record(5, step=210, resumed_from=ckpt)
    )
    assert not retry and "restarts since the last new checkpoint" in reason
    # A new checkpoint in this attempt resets that count.
    assert decide(
        POLICY,
        stalled,
        KILLED,
        400,
        99999.0,
        record(5, step=400, resumed_from=ckpt, checkpointed=True),
    )[0]


def test_killed_twice_while_writing_the_same_checkpoint_is_progress_by_steps_logged():
    # Checkpoints every 4 steps: attempt 1 wrote step 8 and died writing step 12;
    # attempt 2 resumed from 8, trained 9-12 and died writing step 12 again.
    ckpt8 = "/w/runs/r/outputs/checkpoints/step-000008"
    first = record(1, step=12, checkpointed=True)
    for logged in (12, 11):
        current = record(2, step=logged, resumed_from=ckpt8)
        assert decide(POLICY, [first], KILLED, logged, 1000.0, current) == (
            True,
            "killed is retryable",
        )
    # Nothing logged past the checkpoint it resumed from: no progress.
    stuck = record(2, step=8, resumed_from=ckpt8)
    retry, reason = decide(POLICY, [first], KILLED, 8, 1000.0, stuck)
    assert not retry and "made no progress past it" in reason
    # And the loop still ends: attempt 3 from the same checkpoint, as far as attempt 2.
    second = record(2, step=12, resumed_from=ckpt8)
    retry, reason = decide(
        POLICY, [first, second], KILLED, 12, 1000.0, record(3, step=12, resumed_from=ckpt8)
    )
    assert not retry and "again, as attempt 2 did" in reason
