"""The tau walk on text never trained on: samples kept from training
(train.tau_walk_heldout) or the eval prompts answered by the target (train.tau_walk_eval).

Over many epochs the walk on training batches measures what the drafter memorised (a
docstring target's tau~ read 15.5 against an eval tau of 5.2 after 62 epochs); on
held-out samples it measures what serving will see, and on the eval prompts what the
eval will measure."""

from __future__ import annotations

import io
import json

import pytest
import torch
from dflash.dflash_workload import DFlashWorkload
from dflash.pipeline.config_errors import TrainConfigError
from dflash.pipeline.logging import RunLog
from dflash.pipeline.run import train
from dflash.pipeline.train_config import config_from_dict
from dflash.target import greedy_generate, target_context


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
    held, held_again = first.walk_set.samples, again.walk_set.samples
    assert len(held) == 4 and len(first.samples) == 36
    assert [s.input_ids for s in held] == [s.input_ids for s in held_again]
    trained = {tuple(s.input_ids) for s in first.samples}
    assert not any(tuple(s.input_ids) in trained for s in held)
    assert "4 held out for the tau walk" in "\n".join(first.describe())
    assert first.walk_set_label == "held-out samples"
    plain = DFlashWorkload(_config(tmp_path, source))
    assert plain.walk_set is None and len(plain.samples) == 40 and plain.walk_set_label == ""


def test_a_prompt_with_several_answers_is_held_out_whole(tmp_path):
    # regenerate.answers_per_prompt: 3 answers to each of 20 questions. Another answer
    # to a held-out prompt in training would make the held-out walk read what it learnt.
    words = "numbers and lists and a short answer about them".split()
    records = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": " ".join(words[k:] + words[:k])},
            ]
        }
        for i in range(20)
        for k in range(3)
    ]
    source = tmp_path / "answers.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    workload = DFlashWorkload(_config(tmp_path, source, tau_walk_heldout=4))
    held = workload.walk_set.samples
    held_prompts = {tuple(s.prompt_ids) for s in held}
    assert len(held) == 6 and len(held_prompts) == 2  # whole prompts until 4 samples
    assert not any(tuple(s.prompt_ids) in held_prompts for s in workload.samples)
    assert len(workload.samples) + len(held) == 60

    # eval.holdout alike: 4 prompts, one answer each evaluated, none of them trained on
    # (before, another answer of an eval prompt in training was refused as an overlap).
    cfg = _config(tmp_path, source).model_copy(deep=True)
    cfg.eval.enabled, cfg.eval.num_prompts = True, 4
    evals = DFlashWorkload(cfg)
    eval_prompts = {tuple(s.prompt_ids) for s in evals.heldout}
    assert len(evals.heldout) == len(eval_prompts) == 4
    assert len(evals.samples) == 60 - 3 * 4
    cfg.eval.num_prompts = 20  # every prompt: nothing left to train on
    with pytest.raises(TrainConfigError, match="20 held-out prompts leave none of the 60"):
        DFlashWorkload(cfg)


def test_too_few_samples_to_hold_out_warn_and_walk_training_batches(tmp_path):
    workload = DFlashWorkload(_config(tmp_path, _chat_file(tmp_path, 12), tau_walk_heldout=8))
    assert len(workload.walk_set.samples) == 1  # a tenth of 12, not 8
    few = DFlashWorkload(_config(tmp_path, _chat_file(tmp_path, 9), tau_walk_heldout=8))
    assert few.walk_set is None and len(few.samples) == 9
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
    if heldout:  # in turn: each walk starts where the one before stopped (warm-up's first)
        assert workload.walk_set._next == (3 * (1 + len(walked))) % len(workload.walk_set.samples)


# -- train.tau_walk_eval --------------------------------------------------------------------
def _eval_config(tmp_path, **eval_):
    return config_from_dict(
        {
            "output_dir": str(tmp_path / "out"),
            "target": {"preset": "tiny", "dtype": "float32"},
            "drafter": {"num_layers": 1, "block_size": 4, "dtype": "float32"},
            "data": {"source": "synthetic", "num_samples": 16, "seq_len": 48, "batch_size": 2,
                     "num_anchors": 4, "prompt_len": 8},
            "train": {"steps": 4, "log_every": 2, "tau_walk_budget": 1.0, "tau_walk_eval": True,
                      "tau_walk_rows": 3},
            "runtime": {"compile": "eager", "threads": 2, "warmup_iters": 1},
            "eval": {"num_prompts": 3, "max_new_tokens": 20, "batch_size": 2, **eval_},
        }
    )  # fmt: skip


def _fit(drafter, target, samples, layer_ids, block, steps=40):
    """Fit the drafter to the walked text so that it accepts varying lengths (an untrained
    drafter accepts nothing anywhere, where any two measures agree)."""
    from dflash import drafter_loss

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        for sample in samples:
            ids = torch.tensor([sample.input_ids])
            context = target_context(target, ids, None, layer_ids)
            first = sample.loss_mask.index(True)
            anchors = torch.arange(first, len(sample.input_ids) - block + 1)[None]
            loss, _ = drafter_loss(drafter, context, ids, anchors, torch.ones_like(anchors).bool())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return drafter


def test_the_eval_walk_walks_the_eval_prompts_answered_by_the_target(tmp_path):
    workload = DFlashWorkload(_eval_config(tmp_path))
    assert workload.walk_set_label == "eval prompts" and workload.walks_to_cover == 1
    line = workload.prepare_walk()
    assert line.startswith("tau walk: 3 eval prompts answered by the target")
    target = workload.target_for("cpu")
    samples = workload.walk_set.samples
    for prompt, sample in zip(workload.eval_prompts(), samples, strict=True):
        answer, _ = greedy_generate(target, torch.tensor([prompt]), 20)
        assert sample.input_ids == prompt + answer  # the eval's own reference text
        assert sample.loss_mask == [False] * len(prompt) + [True] * len(answer)
    assert workload.prepare_walk() is None  # answered once


def test_the_eval_walk_measures_the_tau_the_eval_measures(tmp_path):
    """The point of walking the eval prompts: the walk's tau is the eval's, for a drafter
    that accepts varying lengths, at a walk's cost."""
    workload = DFlashWorkload(_eval_config(tmp_path))
    workload.prepare_walk()
    target = workload.target_for("cpu")
    drafter = workload.build_drafter(torch.device("cpu"))
    cfg = workload.drafter_cfg
    torch.manual_seed(0)
    _fit(drafter, target, workload.walk_set.samples, cfg.target_layer_ids, cfg.block_size)
    walked = workload.serving_tau(drafter, workload.example_inputs(torch.device("cpu")))
    result = workload.evaluate_drafter(drafter.eval(), target)
    assert result.is_identical
    assert 1.5 < result.tau < cfg.block_size  # the drafter accepts some, not all
    assert walked == pytest.approx(result.tau, rel=1e-9)  # float32: the very same blocks


def test_the_eval_walk_in_a_run_says_so(tmp_path):
    cfg = _eval_config(tmp_path)
    log = RunLog(io.StringIO())
    assert train(cfg, DFlashWorkload(cfg), log, handle_signals=False).exit_code == 0
    assert any(x.startswith("tau walk: 3 eval prompts answered by the target") for x in log.lines)
    walks = [x for x in log.lines if x.startswith("tau walk |")]
    assert walks and all(x.endswith("| eval prompts") for x in walks)
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    walked = [r for r in records if r["kind"] == "step" and r["tau_walk"] is not None]
    assert walked and all(r["tau_walk_set"] == "eval prompts" for r in walked)


def test_no_eval_prompts_to_walk_warns_and_walks_the_batch(tmp_path):
    source = _chat_file(tmp_path, 40)
    cfg = _config(tmp_path, source, tau_walk_eval=True)  # eval off, nothing held out
    workload = DFlashWorkload(cfg)
    assert workload.walk_set is None
    assert "warning: train.tau_walk_eval: no eval prompts" in "\n".join(workload.describe())


def test_the_eval_walk_also_walks_the_last_step_whatever_its_budget(tmp_path):
    """The last walk is then the drafter the end-of-run eval measures (the walk's budget
    alone may have left the last one far before the end)."""
    cfg = _eval_config(tmp_path)
    cfg.train.tau_walk_budget = 1e-9  # only the first walk is due by the budget
    cfg.train.steps = 8
    assert (
        train(cfg, DFlashWorkload(cfg), RunLog(io.StringIO()), handle_signals=False).exit_code == 0
    )
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    walked = [r["step"] for r in records if r["kind"] == "step" and r["tau_walk"] is not None]
    assert walked == [2, 8]


class _TimedWalks(DFlashWorkload):
    """Writes down when each walk ran and whether the meter had started training."""

    def __init__(self, cfg, log):
        super().__init__(cfg)
        self.log, self.walked_after = log, []

    def serving_tau(self, drafter, inputs):
        ready = any(" ready (warm-up" in line for line in self.log.lines)
        self.walked_after.append("warm-up" if ready else "in warm-up")
        return super().serving_tau(drafter, inputs)


def test_warm_up_walks_once_so_the_first_walk_in_training_costs_what_the_rest_do(tmp_path):
    """The walk's one-off costs (kernels, memory for its shapes) land in warm-up, not in
    the walk budget: else a run would walk at its first logged step and then hardly ever."""
    cfg = _eval_config(tmp_path)
    log = RunLog(io.StringIO())
    workload = _TimedWalks(cfg, log)
    assert train(cfg, workload, log, handle_signals=False).exit_code == 0
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    walked = [r["step"] for r in records if r["kind"] == "step" and r["tau_walk"] is not None]
    assert walked == [2, 4]
    assert workload.walked_after == ["in warm-up", "warm-up", "warm-up"]  # not recorded


@pytest.mark.parametrize("batch_size", [1, 2])
def test_the_eval_reuses_the_walks_answers_as_its_greedy_reference(
    tmp_path, monkeypatch, batch_size
):
    """The eval-prompt walk answered the eval prompts as the eval decodes them (its
    batches, or one at a time): the end-of-run eval then decodes only speculatively."""
    import dflash.spec_decode as spec_decode

    workload = DFlashWorkload(_eval_config(tmp_path, batch_size=batch_size))
    workload.prepare_walk()
    target = workload.target_for("cpu")
    drafter = workload.build_drafter(torch.device("cpu")).eval()
    calls = []
    for name in ("greedy_generate_batch_padded", "greedy_generate"):
        monkeypatch.setattr(spec_decode, name, lambda *a, **k: calls.append(a) or [])
    result = workload.evaluate_drafter(drafter, target)
    assert calls == [] and len(result.per_prompt) == 3
    assert [p["greedy_tokens"] for p in result.per_prompt] == [
        s.input_ids[len(prompt) :]
        for prompt, s in zip(workload.eval_prompts(), workload.walk_set.samples, strict=True)
    ]
