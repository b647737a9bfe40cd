"""train.tau_walk_heldout: the exact serving walk on samples kept from training.

Over many epochs the walk on training batches measures what the drafter memorised (a
docstring target's tau~ read 15.5 against an eval tau of 5.2 after 62 epochs); on
held-out samples it measures what serving will see."""

from __future__ import annotations

import io
import json

import pytest
from dflash.dflash_workload import DFlashWorkload
from dflash.pipeline.logging import RunLog
from dflash.pipeline.run import train
from dflash.pipeline.train_config import config_from_dict


def _chat_file(tmp_path, count: int):
    words = "numbers and lists and a short answer about them"
    records = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": " ".join([words] * (1 + i % 3))},
            ]
        }
        for i in range(count)
    ]
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    return source


def _config(tmp_path, source, **train):
    return config_from_dict(
        {
            "output_dir": str(tmp_path / "out"),
            "target": {"preset": "tiny"},
            "drafter": {"num_layers": 1, "block_size": 4},
            "data": {"source": str(source), "seq_len": 64, "batch_size": 2, "num_anchors": 4},
            "train": {"steps": 4, "log_every": 2, "tau_walk_budget": 1.0, **train},
            "runtime": {"compile": "eager", "threads": 2, "warmup_iters": 1},
            "eval": {"enabled": False},
        }
    )


def _prompts(samples):
    return {tuple(s.input_ids[:8]) for s in samples}


def test_held_out_samples_are_kept_from_training_the_same_way_in_every_process(tmp_path):
    source = _chat_file(tmp_path, 40)
    first = DFlashWorkload(_config(tmp_path, source, tau_walk_heldout=4))
    again = DFlashWorkload(_config(tmp_path, source, tau_walk_heldout=4))
    assert len(first.walk_samples) == 4 and len(first.samples) == 36
    assert [s.input_ids for s in first.walk_samples] == [s.input_ids for s in again.walk_samples]
    trained = {tuple(s.input_ids) for s in first.samples}
    assert not any(tuple(s.input_ids) in trained for s in first.walk_samples)
    assert "4 held out for the tau walk" in "\n".join(first.describe())
    plain = DFlashWorkload(_config(tmp_path, source))
    assert plain.walk_samples == [] and len(plain.samples) == 40 and not plain.walks_heldout


def test_too_few_samples_to_hold_out_warn_and_walk_training_batches(tmp_path):
    workload = DFlashWorkload(_config(tmp_path, _chat_file(tmp_path, 12), tau_walk_heldout=8))
    assert len(workload.walk_samples) == 1  # a tenth of 12, not 8
    few = DFlashWorkload(_config(tmp_path, _chat_file(tmp_path, 9), tau_walk_heldout=8))
    assert few.walk_samples == [] and len(few.samples) == 9
    assert "warning: train.tau_walk_heldout 8" in "\n".join(few.describe())


@pytest.mark.parametrize("heldout", [0, 6])
def test_the_walk_line_and_record_say_which_samples_were_walked(tmp_path, heldout):
    cfg = _config(tmp_path, _chat_file(tmp_path, 40), tau_walk_heldout=heldout, tau_walk_rows=3)
    workload = DFlashWorkload(cfg)
    log = RunLog(io.StringIO())
    assert train(cfg, workload, log, handle_signals=False).exit_code == 0
    walks = [x for x in log.lines if x.startswith("tau walk |")]
    assert walks and all(x.endswith("| held-out samples") == bool(heldout) for x in walks)
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    walked = [r for r in records if r["kind"] == "step" and r["tau_walk"] is not None]
    assert walked and all(r["tau_walk_heldout"] is bool(heldout) for r in walked)
    if heldout:  # in turn: the second walk starts where the first stopped
        assert workload._walk_next == (3 * len(walked)) % len(workload.walk_samples)
