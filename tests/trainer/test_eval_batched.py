"""Batched speculative decoding and greedy decoding give what the one-prompt path gives."""

from __future__ import annotations

import dflash.decode_batch as decode_batch
import dflash.spec_decode as spec_decode
import pytest
import torch
from dflash.decode_batch import greedy_generate_batch_padded, speculative_generate_batch
from dflash.spec_decode import accepted_by_position, evaluate, speculative_generate
from dflash.target import greedy_generate

MAX_NEW = 20
LENGTHS = (5, 9, 7, 12)  # unequal: the batch is left-padded


def _prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 500, (n,), generator=gen) for n in LENGTHS]


def _references(target, prompts):
    return [greedy_generate(target, p[None], MAX_NEW)[0] for p in prompts]


def _oracles(monkeypatch, prompts, references, wrong_every):
    """Both paths propose the target's greedy tokens, wrong at every `wrong_every`-th position."""
    fulls = [p.tolist() + r + [0] * 16 for p, r in zip(prompts, references, strict=True)]

    def token_at(full, position):
        token = full[position]
        return (token + 1) % 500 if position % wrong_every == 0 else token

    current = [0]  # which prompt the one-prompt path decodes now
    original = spec_decode.speculative_generate

    def decode_one(drafter, target, prompt_ids, *args, **kwargs):
        ids = prompt_ids.reshape(-1).tolist()
        current[0] = next(i for i, p in enumerate(prompts) if p.tolist() == ids)
        return original(drafter, target, prompt_ids, *args, **kwargs)

    def one(drafter, cache, first_token):
        start, block = cache.length, drafter.cfg.block_size
        logits = torch.zeros(1, block, 512)
        full = fulls[current[0]]
        for k in range(1, block):
            logits[0, k, token_at(full, start + k)] = 1.0
        return logits

    rows = [list(range(len(prompts)))]  # which prompts the batched path decodes now
    original_batch = spec_decode.speculative_generate_batch

    def decode_batch_of(drafter, target, chunk, *args, **kwargs):
        rows[0] = [
            next(i for i, p in enumerate(prompts) if p.tolist() == c.tolist()) for c in chunk
        ]
        return original_batch(drafter, target, chunk, *args, **kwargs)

    def batch(drafter, cache, first, start):
        block = drafter.cfg.block_size
        proposals = [
            [token_at(fulls[i], int(s) + k) for k in range(1, block)]
            for i, s in zip(rows[0], start.tolist(), strict=True)
        ]
        return torch.tensor(proposals)

    monkeypatch.setattr(spec_decode, "draft_block_logits", one)
    monkeypatch.setattr(spec_decode, "speculative_generate", decode_one)
    monkeypatch.setattr(spec_decode, "speculative_generate_batch", decode_batch_of)
    monkeypatch.setattr(decode_batch, "draft_blocks", batch)


def _same(one, batched):
    assert batched.tokens == one.tokens
    assert batched.acceptance_lengths == one.acceptance_lengths
    assert batched.target_forwards == one.target_forwards
    assert batched.verify_argmax == one.verify_argmax
    assert batched.verify_margin == pytest.approx(one.verify_margin, abs=1e-4)


def test_batched_greedy_equals_one_prompt_greedy(tiny_target):
    prompts = _prompts()
    batched = greedy_generate_batch_padded(tiny_target, prompts, MAX_NEW)
    for prompt, (tokens, margins) in zip(prompts, batched, strict=True):
        expected_margins: list[float] = []
        expected, _ = greedy_generate(tiny_target, prompt[None], MAX_NEW, margins=expected_margins)
        assert tokens == expected
        assert margins == pytest.approx(expected_margins, abs=1e-4)


def test_batched_speculative_equals_one_prompt_with_an_untrained_drafter(tiny_target, make_drafter):
    drafter, prompts = make_drafter(seed=1), _prompts()
    batched = speculative_generate_batch(drafter, tiny_target, prompts, MAX_NEW)
    for prompt, out in zip(prompts, batched, strict=True):
        _same(speculative_generate(drafter, tiny_target, prompt[None], MAX_NEW), out)


def test_batched_speculative_equals_one_prompt_when_rows_accept_differently(
    tiny_target, make_drafter, monkeypatch
):
    prompts = _prompts()
    references = _references(tiny_target, prompts)
    _oracles(monkeypatch, prompts, references, wrong_every=3)
    drafter = make_drafter()
    batched = speculative_generate_batch(drafter, tiny_target, prompts, MAX_NEW)
    for prompt, reference, out in zip(prompts, references, batched, strict=True):
        assert out.tokens == reference
        _same(spec_decode.speculative_generate(drafter, tiny_target, prompt[None], MAX_NEW), out)
    lengths = {n for out in batched for n in out.acceptance_lengths}
    assert max(lengths) > 1  # drafts were accepted, by different amounts across rows


def test_evaluate_reports_the_same_in_batches_as_one_at_a_time(
    tiny_target, make_drafter, monkeypatch
):
    prompts = _prompts()
    references = _references(tiny_target, prompts)
    _oracles(monkeypatch, prompts, references, wrong_every=4)
    stops = [references[1][6]]  # ends one row early: rows finish at different steps
    drafter = make_drafter()
    kwargs = dict(max_new_tokens=MAX_NEW, stop_token_ids=stops)
    one = evaluate(drafter, tiny_target, prompts, **kwargs)
    batched = evaluate(drafter, tiny_target, prompts, batch_size=3, **kwargs)
    assert batched.tau == one.tau and batched.num_tokens == one.num_tokens
    assert batched.tokens_per_target_forward == one.tokens_per_target_forward
    assert batched.format_line() == one.format_line()
    assert batched.lossless and batched.is_identical and one.tau > 1.5
    for a, b in zip(one.per_prompt, batched.per_prompt, strict=True):
        assert (a["tokens"], a["acceptance_lengths"]) == (b["tokens"], b["acceptance_lengths"])
    # Per-position acceptance: the same either way, and what the steps say.
    assert batched.accepted_by_position == one.accepted_by_position
    steps = [n for p in one.per_prompt for n in p["acceptance_lengths"]]
    assert one.accepted_by_position[0] == pytest.approx(sum(n >= 2 for n in steps) / len(steps))
    assert one.accepted_by_position == sorted(one.accepted_by_position, reverse=True)
    assert one.metrics()["accepted_by_position"] == one.accepted_by_position


def test_accepted_by_position_counts_each_drafted_slot():
    # Block 4: steps that kept 1, 4 and 2 tokens accepted slots {}, {1, 2, 3} and {1}.
    assert accepted_by_position([1, 4, 2], 4) == pytest.approx([2 / 3, 1 / 3, 1 / 3], abs=1e-3)
    assert accepted_by_position([], 4) == []


def test_evaluate_refuses_a_batch_size_below_one(tiny_target, make_drafter):
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(make_drafter(), tiny_target, _prompts(), batch_size=0)


def test_batched_drafter_proposes_what_the_one_prompt_drafter_proposes(
    tiny_target, make_drafter, monkeypatch
):
    """The drafter side on its own: every block each row drafts (context masks, positions)."""
    drafter, prompts = make_drafter(seed=2), _prompts()
    one_calls: list[list[int]] = []
    batch_calls: list[list[list[int]]] = []
    one, batch = spec_decode.draft_block_logits, decode_batch.draft_blocks

    def record_one(*args):
        logits = one(*args)
        one_calls.append(logits[0, 1:].argmax(-1).tolist())
        return logits

    def record_batch(*args):
        proposals = batch(*args)
        batch_calls.append(proposals.tolist())
        return proposals

    monkeypatch.setattr(spec_decode, "draft_block_logits", record_one)
    monkeypatch.setattr(decode_batch, "draft_blocks", record_batch)
    speculative_generate_batch(drafter, tiny_target, prompts, MAX_NEW)
    for row, prompt in enumerate(prompts):
        one_calls.clear()
        spec_decode.speculative_generate(drafter, tiny_target, prompt[None], MAX_NEW)
        assert one_calls and [step[row] for step in batch_calls[: len(one_calls)]] == one_calls


def _count_greedy(monkeypatch):
    """Count the greedy decodes the eval makes (batched and one prompt at a time)."""
    calls = []
    for name in ("greedy_generate_batch_padded", "greedy_generate"):
        real = getattr(spec_decode, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(spec_decode, name, counted)
    return calls


@pytest.mark.parametrize("batch_size", [1, 3])
def test_kept_references_give_the_same_eval_without_decoding_greedy_again(
    tiny_target, make_drafter, monkeypatch, batch_size
):
    """The target is frozen, so a run's second eval reuses the first one's greedy side:
    the same result, without a greedy decode."""
    drafter, prompts = make_drafter(seed=3), _prompts()
    kw = dict(max_new_tokens=MAX_NEW, batch_size=batch_size)
    fresh = evaluate(drafter, tiny_target, prompts, **kw)
    calls = _count_greedy(monkeypatch)
    references = spec_decode.GreedyReferences()
    first = evaluate(drafter, tiny_target, prompts, references=references, **kw)
    assert len(calls) == (len(prompts) if batch_size == 1 else 2)  # 4 prompts, batches of 3
    calls.clear()
    second = evaluate(drafter, tiny_target, prompts, references=references, **kw)
    assert calls == []
    for again in (first, second):
        assert again.to_dict() == fresh.to_dict()


def test_references_are_kept_per_target_and_per_setting(tiny_target):
    from dflash import build_tiny_target

    other, prompts = build_tiny_target(seed=1), _prompts()[:2]
    references = spec_decode.GreedyReferences()
    mine = references.of(tiny_target, prompts, MAX_NEW, None)
    assert references.of(other, prompts, MAX_NEW, None) == greedy_generate_batch_padded(
        other, prompts, MAX_NEW
    )
    assert references.of(tiny_target, prompts, MAX_NEW - 5, None)[0][0] == mine[0][0][:-5]
    assert references.of(tiny_target, prompts, MAX_NEW, None) is mine


def test_the_pad_id_changes_no_greedy_row(tiny_target):
    """The eval-prompt walk's answers stand in for the eval's greedy reference: both are
    left-padded, and a pad slot is hidden from every query, so its id changes nothing."""
    prompts = _prompts()
    zero = greedy_generate_batch_padded(tiny_target, prompts, MAX_NEW, pad_id=0)
    assert greedy_generate_batch_padded(tiny_target, prompts, MAX_NEW, pad_id=77) == zero
