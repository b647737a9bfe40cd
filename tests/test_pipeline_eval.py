"""The end-of-run eval: held-out prompts, measured on the saved checkpoint, equal to a fresh process."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from dflash.dflash_workload import DFlashWorkload
from dflash.pipeline.logging import RunLog
from dflash.pipeline.run import train
from dflash.pipeline.train_config import TrainConfigError, load_train_config

TRAINER = Path(__file__).resolve().parents[1] / "trainer"
TINY = TRAINER / "configs" / "tiny-cpu.yaml"


def _evaluate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash.evaluate", *args],
        cwd=TRAINER,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_end_of_run_eval_equals_a_fresh_process_eval_of_the_checkpoint(tmp_path):
    cfg = load_train_config(
        TINY,
        [
            f"output_dir={tmp_path}",
            "train.steps=60",
            "data.num_samples=32",
            "eval.max_new_tokens=24",
        ],
    )
    log = io.StringIO()
    result = train(cfg, DFlashWorkload(cfg), RunLog(log), handle_signals=False)
    assert result.exit_code == 0, log.getvalue()[-2000:]
    checkpoint = tmp_path / "checkpoints" / "step-000060"
    assert result.checkpoint == checkpoint
    assert f"| checkpoint {checkpoint} (drafter bfloat16) |" in result.eval_line
    in_run = json.loads((checkpoint / "eval.json").read_text())
    assert in_run["checkpoint"] == f"{checkpoint} (drafter bfloat16)"

    fresh = _evaluate("--checkpoint", str(checkpoint))
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert fresh.stdout.splitlines()[0] == result.eval_line  # same tau, tokens, everything
    assert json.loads((checkpoint / "eval.json").read_text()) == in_run  # per prompt too
    assert [p["tokens"] for p in in_run["prompts"]] == [
        p["greedy_tokens"] for p in in_run["prompts"]
    ]

    verified = _evaluate("--checkpoint", str(checkpoint), "--float32-verify")
    assert verified.returncode == 0, verified.stderr[-2000:]
    report = json.loads((checkpoint / "eval-float32.json").read_text())
    assert report["target_dtype"] == "float32" and report["lossless"]


def test_evaluate_refuses_a_folder_without_a_config(tmp_path):
    out = _evaluate("--checkpoint", str(tmp_path))
    assert out.returncode == 2
    assert "pass --config" in out.stderr and "Traceback" not in out.stderr


def _text_config(tmp_path, *extra):
    docs = [" ".join(f"word{(i * 7 + j) % 23} and {j}" for j in range(12)) for i in range(10)]
    data = tmp_path / "docs.txt"
    data.write_text("\n\n".join(docs) + "\n")
    return load_train_config(
        TINY,
        [
            f"output_dir={tmp_path}",
            f"data.source={data}",
            "data.seq_len=48",
            "eval.num_prompts=3",
            "eval.prompt_tokens=6",
            *extra,
        ],
    )


def test_plain_text_data_holds_out_documents_and_prompts_from_them(tmp_path):
    cfg = _text_config(tmp_path)
    workload = DFlashWorkload(cfg)
    assert len(workload.heldout) == 3 and len(workload.samples) == 7
    trained = [s.input_ids for s in workload.samples]
    assert all(s.input_ids not in trained for s in workload.heldout)
    prompts = workload.eval_prompts()
    assert len(prompts) == 3
    for prompt, sample in zip(prompts, workload.heldout, strict=True):
        assert prompt == sample.input_ids[:6]  # a held-out document's first tokens
    again = DFlashWorkload(cfg)  # deterministic: another process holds out the same ones
    assert [s.input_ids for s in again.heldout] == [s.input_ids for s in workload.heldout]


def test_holding_out_everything_is_a_config_error(tmp_path):
    with pytest.raises(TrainConfigError, match="eval.holdout"):
        DFlashWorkload(_text_config(tmp_path, "eval.holdout=10"))


def test_eval_every_records_serving_tau_during_training(tmp_path):
    """eval.every: speculative decoding on the held-out prompts while training goes on, in
    the log, metrics.jsonl and TensorBoard; the last step's eval is the end-of-run one."""
    overrides = [
        f"output_dir={tmp_path}",
        "train.steps=30",
        "train.log_every=10",
        "data.num_samples=16",
        "eval.every=10",
        "eval.num_prompts=2",
        "eval.max_new_tokens=12",
    ]
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    if tensorboard:
        overrides.append("logging.tensorboard=true")
    cfg = load_train_config(TINY, overrides)
    log = io.StringIO()
    result = train(cfg, DFlashWorkload(cfg), RunLog(log), handle_signals=False)
    assert result.exit_code == 0, log.getvalue()[-2000:]
    text = log.getvalue()
    assert "eval at step 10 | tau " in text and "eval at step 20 | tau " in text
    assert "eval at step 30" not in text  # the end-of-run eval covers it
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [10, 20, 30]
    assert [e.get("during_training", False) for e in evals] == [True, True, False]
    assert all(e["lossless"] and e["tau"] >= 1.0 for e in evals)
    if tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        board = EventAccumulator(str(tmp_path / "tensorboard"))
        board.Reload()
        assert [e.step for e in board.Scalars("eval/tau")] == [10, 20, 30]
        assert "train/tau" in board.Tags()["scalars"]


def test_eval_prompts_that_were_trained_on_are_refused(tmp_path):
    """An eval file whose prompts are also training prompts measures memorisation: refused."""
    chat = tmp_path / "chat.jsonl"
    lines = []
    for i in range(12):
        question = f"question number {i}: what is {i} plus {i}?"
        answer = " ".join(["the answer is", str(2 * i)] * 6)
        lines.append(
            {
                "messages": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    chat.write_text("".join(json.dumps(r) + "\n" for r in lines))
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(json.dumps(r) + "\n" for r in lines[:2]))
    base = [f"output_dir={tmp_path}", f"data.source={chat}", "data.seq_len=64"]
    cfg = load_train_config(TINY, [*base, f"eval.source={evals}"])
    with pytest.raises(TrainConfigError, match=r"2 of the eval.source .* also prompts of training"):
        DFlashWorkload(cfg)
    # Held out from the same file, or a disjoint file: accepted.
    DFlashWorkload(load_train_config(TINY, [*base, "eval.num_prompts=2"]))
    fresh = tmp_path / "fresh.jsonl"
    fresh.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "something new"}, lines[0]["messages"][1]]}
        )
        + "\n"
    )
    DFlashWorkload(load_train_config(TINY, [*base, f"eval.source={fresh}"]))
