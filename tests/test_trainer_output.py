"""The contract between the trainer and dflashctl, checked on the real thing: the tiny
CPU run's own log fed to dflashctl's run summary and crash detector, and its
metrics.jsonl checked against its step lines (the runs: tests/tiny_run.py)."""

from __future__ import annotations

import re

import pytest

from dflashctl.crash import load_rules
from dflashctl.follow import classify_log
from dflashctl.runs.summary import RunSummary

pytestmark = pytest.mark.slow


def test_metrics_jsonl_matches_the_step_lines(tiny_runs):
    run = tiny_runs["clean"]
    assert run.exit_code == 0, run.log[-2000:] + run.stderr[-2000:]
    step_lines = [line for line in run.lines if line.startswith("step ")]
    records = run.records()
    start = records[0]  # first, the resolved config
    assert start["kind"] == "start" and start["step"] == 0
    assert (
        start["config"]["train"]["steps"] == 40 and start["config"]["runtime"]["compile"] == "eager"
    )
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [10, 20, 30, 40]
    for line, record in zip(step_lines, steps, strict=True):
        fields = re.fullmatch(
            r"step (\d+)/40 \| loss (\S+) \| acc (\S+) \| tau~ (\S+) \| lr \S+ \| grad_norm \S+ \| (\d+) tok/s \| "
            r"mfu n/a \| queue (\d+)/4 \| eta (\S+)",
            line,
        )
        assert fields, line
        assert int(fields[1]) == record["step"] and record["total_steps"] == 40
        assert float(fields[2]) == pytest.approx(record["loss"], abs=5e-5)
        assert float(fields[3]) == pytest.approx(record["acc"], abs=5e-3)
        assert float(fields[4]) == pytest.approx(record["tau"], abs=5e-3)
        assert int(fields[5]) == round(record["tokens_per_s"])
        assert int(fields[6]) == record["queue_depth"] and record["queue_size"] == 4
        assert len(record["acc_per_slot"]) == 3  # block 4: slots 1..3 carry a loss
        # tau~ is the step anchors' serving estimate (a block commits 1 to 4 tokens),
        # beside the sampled anchors' mean acceptance and the exact walk when it ran
        assert 1 <= record["tau"] <= 4 and 1 <= record["tau_anchors"] <= 4
        assert record["tau_walk"] is None or 1 <= record["tau_walk"] <= 4
        assert record["lr"] > 0 and record["mfu"] is None and record["eta_s"] >= 0
    assert step_lines[-1].endswith("| eta 0s")
    assert [r["time"] for r in steps] == sorted(r["time"] for r in steps)
    (evaluation,) = [r for r in records if r["kind"] == "eval"]
    eval_line = next(line for line in run.lines if line.startswith("eval | "))
    assert eval_line.startswith(f"eval | tau {evaluation['tau']:.2f} | lossless yes | ")
    assert evaluation["step"] == 40 and evaluation["tokens"] == 8 and evaluation["lossless"] is True


def test_run_summary_reads_the_real_log(tiny_runs):
    run = tiny_runs["clean"]
    summary = RunSummary()
    for line in run.lines:
        summary.feed(line)
    last = [r for r in run.records() if r["kind"] == "step"][-1]
    assert summary.last_step == "40/40"
    assert summary.final_loss == pytest.approx(last["loss"], abs=5e-5)
    evaluation = [r for r in run.records() if r["kind"] == "eval"][0]
    assert summary.tau == pytest.approx(evaluation["tau"], abs=5e-3) and summary.lossless is True
    assert summary.eval_tokens == 8
    assert summary.checkpoint == str(run.run_dir / "outputs" / "checkpoints" / "step-000040")


def test_crash_detector_finds_nothing_in_a_clean_real_log(tiny_runs):
    run = tiny_runs["clean"]
    result = classify_log(
        [run.log.encode()], rules=load_rules(), exit_code=0, lines=0, name="clean", show_lines=False
    )
    assert result.status == "finished" and result.crashes == []


def test_crash_detector_names_the_failed_thread_in_a_real_log(tiny_runs):
    run = tiny_runs["crash"]
    assert run.exit_code == 1
    result = classify_log(
        [run.log.encode()], rules=load_rules(), exit_code=1, lines=0, name="crash", show_lines=False
    )
    assert result.status == "crashed"
    root = result.crashes[0]
    assert (
        root.thread == "drafter-0" and root.exception == "dflash.pipeline.threads.InjectedFailure"
    )
    assert root.stage == "training"
    assert result.summary.last_step == "20/40"  # the step line before the failure
    steps = [r["step"] for r in run.records() if r["kind"] == "step"]
    assert steps == [10, 20]  # what was logged before the failure stays on disk


def test_a_stopped_run_keeps_what_it_logged(tiny_runs):
    run = tiny_runs["stopped"]
    assert run.exit_code == 0
    assert any(line.startswith("stopped by SIGTERM after step 25/40") for line in run.lines)
    assert [r["step"] for r in run.records() if r["kind"] == "step"] == [10, 20]
    result = classify_log(
        [run.log.encode()],
        rules=load_rules(),
        exit_code=0,
        lines=0,
        name="stopped",
        show_lines=False,
    )
    assert result.crashes == [] and result.summary.last_step == "20/40"
