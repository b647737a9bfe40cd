"""The end-of-run summary read from the trainer's log lines."""

from __future__ import annotations

import json
import subprocess
import sys

from dflashctl.runs.summary import RunSummary
from tests.json_answers import flat

TAIL = """\
drafter-0 on cpu: ready (warm-up 0.0 s)
step 200/240 | loss 5.5050 | acc 0.11 | tau~ 1.17 | lr 1.7e-3 | 8069 tok/s | mfu n/a | queue 4/4
step 240/240 | loss 4.7542 | acc 0.56 | tau~ 2.29 | lr 1.0e-3 | 10280 tok/s | mfu n/a | queue 0/4
checkpoint: /w/runs/r1/outputs/checkpoints/step-000240
final loss 4.7542
eval | tau 1.28 | lossless yes | 128 tokens | 1.3 tokens/target forward
drafter checkpoint: /w/runs/r1/outputs/checkpoints/step-000240
training complete
"""


def summarise(text: str) -> RunSummary:
    summary = RunSummary()
    for line in text.splitlines():
        summary.feed(line)
    return summary


def test_reads_loss_tau_and_checkpoint():
    summary = summarise(TAIL)
    assert summary.final_loss == 4.7542
    assert summary.last_step == "240/240"
    assert summary.tau == 1.28 and summary.lossless is True
    assert summary.eval_tokens == 128 and summary.tokens_per_target_forward == 1.3
    assert summary.checkpoint == "/w/runs/r1/outputs/checkpoints/step-000240"
    assert summary.describe() == [
        "checkpoint  /w/runs/r1/outputs/checkpoints/step-000240",
        "result      final loss 4.754 · eval tau 1.28, lossless yes",
    ]


def test_a_lossy_eval_is_shouted_and_a_log_without_results_says_nothing():
    lossy = summarise("eval | tau 3.10 | lossless no | 64 tokens\n")
    assert lossy.lossless is False and lossy.tokens_per_target_forward is None
    assert lossy.describe() == ["result      eval tau 3.10, lossless NO"]
    tie = summarise(
        "eval | tau 2.10 | lossless yes (exact; 18 of 32 prompts meet bf16 near-ties) | 64 tokens\n"
    )
    assert tie.lossless is True and tie.tau == 2.10
    bug = summarise("eval | tau 2.10 | lossless NO: bug at prompt 3, token 7 | 64 tokens\n")
    assert bug.lossless is False
    plain = summarise("hello\nstep one\nfinal answer\n")
    assert plain.empty and plain.describe() == []


def test_logs_file_json_carries_the_summary(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(TAIL)
    result = subprocess.run(
        [sys.executable, "-m", "dflashctl", "logs", "--file", str(log), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    data = flat(json.loads(result.stdout))
    assert data["status"] == "finished"
    assert data["summary"]["tau"] == 1.28
    assert data["summary"]["checkpoint"].endswith("step-000240")


def test_a_copied_log_without_exit_code_is_not_called_finished(tmp_path):
    log = tmp_path / "cut.log"
    log.write_text("step 1/10 | loss 2.0\nstep 2/10 | loss 1.9\n")
    result = subprocess.run(
        [sys.executable, "-m", "dflashctl", "logs", "--file", str(log)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "no crash found" in result.stderr and "--exit-code" in result.stderr
    assert "finished" not in result.stderr
