"""When speculative output differs from greedy, the eval report tells a bug from a near-tie."""

from __future__ import annotations

import dflash.spec_decode as spec_decode
import torch
from dflash.spec_decode import evaluate
from dflash.target import greedy_generate
from torch import nn

MAX_NEW = 16
PROMPT = torch.randint(0, 500, (1, 7), generator=torch.Generator().manual_seed(3))


class NearTieTarget(nn.Module):
    """The tiny target, except that at one position its top-2 logits are 1e-3 apart and
    the order flips between a block forward and a one-token forward: what bf16 rounding
    does to a real target at a near-tie, built on purpose so the test can rely on it."""

    def __init__(self, inner: nn.Module, position: int, gap: float = 1e-3) -> None:
        super().__init__()
        self.inner, self.position, self.gap, self.config = inner, position, gap, inner.config

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, input_ids, position_ids, use_cache, output_hidden_states, cache=None):
        out = self.inner(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            cache=cache,
        )
        block = input_ids.shape[1] > 1
        for row in (position_ids[0] == self.position).nonzero().flatten().tolist():
            logits = out.logits[0, row]
            top = logits.topk(2).indices
            best = logits[top[0]].clone()
            logits[top[1]] = best + self.gap if block else best - self.gap
        return out


def test_a_broken_verifier_is_reported_as_a_bug(tiny_target, make_drafter, monkeypatch):
    """A verifier that accepts every drafted token: the output differs, verification is not exact."""
    monkeypatch.setattr(spec_decode, "accepted_prefix", lambda proposal, verified: len(proposal))
    result = evaluate(make_drafter(seed=1), tiny_target, [PROMPT[0]], max_new_tokens=MAX_NEW)
    assert not result.lossless and not result.verification_exact
    (div,) = result.divergences
    reference, _ = greedy_generate(tiny_target, PROMPT, MAX_NEW)
    assert div.prompt == 0 and div.greedy_token == reference[div.position]
    assert div.speculative_token != div.greedy_token
    assert not div.verification_exact and div.verdict.startswith("bug")
    line = result.format_line()
    assert f"lossless NO: bug at prompt 0, token {div.position} |" in line
    assert "verification NOT exact: bug" in line
    assert result.per_prompt[0]["divergence"]["position"] == div.position


def test_a_near_tie_is_told_apart_from_a_bug(tiny_target, make_drafter):
    """Block verification picks the runner-up at a near-tie: exact verification, tiny margin."""
    position = PROMPT.shape[1] + 4  # a row verified inside a block, not in the prefill
    target = NearTieTarget(tiny_target, position)
    result = evaluate(make_drafter(seed=1), target, [PROMPT[0]], max_new_tokens=MAX_NEW)
    # Nothing is wrong: the headline says lossless, and counts the near-tie.
    assert result.lossless and not result.is_identical and result.verification_exact
    (div,) = result.divergences
    assert div.position == position - PROMPT.shape[1] + 1  # the token after that row
    assert abs(div.greedy_margin - 1e-3) < 1e-4 and abs(div.verify_margin - 1e-3) < 1e-4
    assert div.near_tie and div.verdict.startswith("near-tie")
    line = result.format_line()
    assert "| lossless yes (exact; 1 of 1 prompts meet fp32 near-ties) |" in line
    assert "verification exact: near-tie" in line
    assert result.metrics()["near_ties"] == 1 and result.metrics()["bugs"] == 0


def test_a_real_disagreement_with_exact_verification_is_a_bug(tiny_target, make_drafter):
    """The same flip with a wide margin (as a wrong cache position would give) is no tie."""
    position = PROMPT.shape[1] + 4
    target = NearTieTarget(tiny_target, position, gap=2.0)
    result = evaluate(make_drafter(seed=1), target, [PROMPT[0]], max_new_tokens=MAX_NEW)
    (div,) = result.divergences
    assert result.verification_exact and not div.near_tie
    assert abs(div.verify_margin - 2.0) < 1e-4 and div.greedy_margin > 1e-3  # fp32 threshold
    assert div.verdict.startswith("bug: verification exact")
    assert not result.lossless
    assert f"lossless NO: bug at prompt 0, token {div.position} |" in result.format_line()
