# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""The bundled trainer in a container of the test host, SIGKILLed at step 6 in every
attempt, just after its step-4 checkpoint and before its next step line (it logs every
4 steps): the supervisor retries once, sees the retry get no further than the
checkpoint it resumed from, and ends the run, instead of looping to max_restarts."""

from __future__ import annotations

import json
import re

import pytest

from tests.test_recovery import cli
from tests.test_recovery_container import RECIPE, WORKDIR

pytestmark = pytest.mark.slow

EVERY_TIME = [
    "--set", "train.log_every=4",
    "--set", "debug.fail_in=drafter-0@step:6",
    "--set", "debug.fail_kind=sigkill",
]  # fmt: skip


def test_a_kill_just_after_the_same_checkpoint_every_time_ends_after_one_retry(
    tmp_path, container, write_config, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_config(
        tmp_path,
        **{"trainer.args": RECIPE + EVERY_TIME, "run.retry": {"backoff_s": 0, "max_restarts": 5}},
    )
    done = cli("deploy", "-c", str(path), timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    (run_dir,) = container.host_path(f"{WORKDIR}/runs").iterdir()
    attempts = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    assert [a["retried"] for a in attempts] == [True, False]
    first_attempt = done.stdout.split("dflashctl: attempt 1/6 crashed")[0]
    if re.search(r"^checkpoint: \S+/step-000004 ", first_attempt, re.MULTILINE):
        # The usual case: the step-4 checkpoint was durable before the kill.
        assert attempts[1]["resumed_from"].endswith("step-000004")
        assert "made no progress past it" in attempts[1]["reason"]
    else:  # on a loaded machine it may not be: both attempts then end at step 4
        assert "it crashed at step 4 again" in attempts[1]["reason"]
    assert "not retried: " in done.stderr
