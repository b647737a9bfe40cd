"""Speculative decoding is lossless and counts acceptance correctly."""

from __future__ import annotations

import re

import dflash.spec_decode as spec_decode
import pytest
import torch
from dflash.spec_decode import EvalResult, evaluate, speculative_generate
from dflash.target import greedy_generate

MAX_NEW = 24


def _prompt(seed, length=7):
    return torch.randint(0, 500, (1, length), generator=torch.Generator().manual_seed(seed))


def _oracle(monkeypatch, prompt, reference, wrong_every=None):
    """Replace the drafter's proposals with the target's greedy tokens, optionally corrupted."""
    full = prompt[0].tolist() + reference + [0] * 16
    vocab = 512

    def fake_draft(drafter, cache, first_token):
        start, block = cache.length, drafter.cfg.block_size
        logits = torch.zeros(1, block, vocab)
        for k in range(1, block):
            token = full[start + k]
            if wrong_every and (start + k) % wrong_every == 0:
                token = (token + 1) % 500
            logits[0, k, token] = 1.0
        return logits

    monkeypatch.setattr(spec_decode, "draft_block_logits", fake_draft)


def test_untrained_drafter_is_still_lossless(tiny_target, make_drafter):
    drafter = make_drafter(seed=1)
    for seed in range(3):
        prompt = _prompt(seed)
        reference, _ = greedy_generate(tiny_target, prompt, MAX_NEW)
        out = speculative_generate(drafter, tiny_target, prompt, MAX_NEW)
        assert out.tokens == reference
        assert sum(out.acceptance_lengths) == MAX_NEW - 1  # the prefill made the first token


def test_perfect_proposals_are_all_accepted(tiny_target, make_drafter, monkeypatch):
    prompt = _prompt(7)
    reference, forwards = greedy_generate(tiny_target, prompt, MAX_NEW)
    assert forwards == MAX_NEW
    _oracle(monkeypatch, prompt, reference)
    out = speculative_generate(make_drafter(), tiny_target, prompt, MAX_NEW)
    assert out.tokens == reference
    assert out.acceptance_lengths[:-1] == [4] * (len(out.acceptance_lengths) - 1)
    assert out.target_forwards == 1 + len(out.acceptance_lengths)


def test_partly_wrong_proposals_stay_lossless(tiny_target, make_drafter, monkeypatch):
    prompt = _prompt(8)
    reference, _ = greedy_generate(tiny_target, prompt, MAX_NEW)
    _oracle(monkeypatch, prompt, reference, wrong_every=3)
    out = speculative_generate(make_drafter(), tiny_target, prompt, MAX_NEW)
    assert out.tokens == reference
    assert 1 < max(out.acceptance_lengths) < 4  # some drafts accepted, none a full block


def test_stop_token_ends_both_paths_alike(tiny_target, make_drafter, monkeypatch):
    prompt = _prompt(9)
    reference, _ = greedy_generate(tiny_target, prompt, MAX_NEW)
    stop = reference[10]
    expected, _ = greedy_generate(tiny_target, prompt, MAX_NEW, stop_token_ids=[stop])
    assert expected[-1] == stop and len(expected) <= 11
    _oracle(monkeypatch, prompt, reference)
    out = speculative_generate(make_drafter(), tiny_target, prompt, MAX_NEW, stop_token_ids=[stop])
    assert out.tokens == expected


def test_evaluate_reports_and_formats(tiny_target, make_drafter, monkeypatch):
    prompt = _prompt(11)
    reference, _ = greedy_generate(tiny_target, prompt, MAX_NEW)
    _oracle(monkeypatch, prompt, reference)
    result = evaluate(make_drafter(), tiny_target, [prompt[0].tolist()], max_new_tokens=MAX_NEW)
    assert result.lossless and result.num_tokens == MAX_NEW
    assert result.tau > 3.0 and result.tokens_per_target_forward > 3.0
    line = result.format_line()
    assert re.fullmatch(
        r"eval \| tau \d+\.\d\d \| lossless yes \| 24 tokens \| \d+\.\d tokens/target forward", line
    )


def test_evaluate_flags_a_lossy_decoder(tiny_target, make_drafter, monkeypatch):
    def broken(drafter, target, prompt_ids, max_new_tokens, stop_token_ids=None):
        out = spec_decode.SpecOutput(
            tokens=[1] * max_new_tokens, acceptance_lengths=[1] * max_new_tokens
        )
        out.target_forwards = max_new_tokens
        return out

    monkeypatch.setattr(spec_decode, "speculative_generate", broken)
    result = evaluate(make_drafter(), tiny_target, [_prompt(1)[0]], max_new_tokens=8)
    assert not result.lossless and result.mismatched_prompts == [0]
    assert result.first_divergence == {0: 0}
    assert "lossless NO: bug at prompt 0, token 0 |" in result.format_line()


def test_format_line_shape():
    line = EvalResult(
        tau=2.414, lossless=True, num_tokens=512, tokens_per_target_forward=3.14, num_prompts=4
    ).format_line()
    assert line == "eval | tau 2.41 | lossless yes | 512 tokens | 3.1 tokens/target forward"


def test_evaluate_needs_prompts(tiny_target, make_drafter):
    with pytest.raises(ValueError):
        evaluate(make_drafter(), tiny_target, [])
