"""tau~ without the walk, and the walk made cheaper.

- The step line's tau~ comes from the training step's own anchors (`blocks_per_token`:
  the share whose first drafted token is wrong, plus the share that accept all over B).
  It equals the serving walk exactly where acceptance counts down towards the next miss
  and stretches are shorter than a block; elsewhere it is an estimate (trainer/README.md
  says how close on trained drafters).
- `dense_acceptance` computes the context keys once and runs anchors in larger chunks
  with the LM head chunked on its own: the same lengths as before, anchor for anchor.
"""

from __future__ import annotations

import random

import pytest
import torch
from dflash import drafter_loss, sample_anchors, target_context
from dflash.data import collate, synthetic_samples
from dflash.objective import block_labels, drafter_block_hidden
from dflash.serving_walk import anchor_tau, blocks_per_token, dense_acceptance, walk, walk_tau

from tests.trainer.conftest import BLOCK


def _walk_tau(lengths: list[int]) -> float:
    visited = walk(lengths)
    return sum(visited) / len(visited)


def _countdown(stretches: list[int], block: int) -> list[int]:
    """Acceptance lengths of text whose misses end stretches of these lengths: an anchor
    p accepts min(B, h - p), h the stretch's end."""
    lengths = []
    for g in stretches:
        lengths += [min(block, g - u) for u in range(g)]
    return lengths


def test_the_estimate_is_the_walk_where_acceptance_counts_down_in_short_stretches():
    rng = random.Random(3)
    for block in (4, 8, 16):
        stretches = [rng.randint(1, block - 1) for _ in range(300)]
        lengths = _countdown(stretches, block)
        assert anchor_tau(lengths, block) == pytest.approx(_walk_tau(lengths), rel=1e-12)
        # The harmonic mean of the lengths, the first idea, is far below it.
        harmonic = len(lengths) / sum(1 / x for x in lengths)
        assert harmonic < 0.9 * _walk_tau(lengths)


def test_the_estimate_stays_close_with_stretches_longer_than_a_block():
    rng = random.Random(4)
    block = 4
    stretches = [rng.randint(1, 3 * block) for _ in range(400)]
    lengths = _countdown(stretches, block)
    walked = _walk_tau(lengths)
    assert anchor_tau(lengths, block) != pytest.approx(walked, rel=1e-6)  # not exact here
    assert anchor_tau(lengths, block) == pytest.approx(walked, rel=0.08)


def test_no_drafting_anchor_no_estimate():
    assert anchor_tau([0, 0], 4) is None
    assert blocks_per_token(0.0, 0.0, 4) is None
    assert 1 / blocks_per_token(0.0, 1.0, 4) == 4  # all accepted: B tokens a block
    assert 1 / blocks_per_token(0.0, 0.1, 4) == 4  # never more than B a block


@pytest.fixture(scope="module")
def trained(tiny_target):
    """A drafter fitted a little to the target's own text, so acceptance varies."""
    from dflash import DFlashDrafter, DrafterConfig, target_parts

    cfg = DrafterConfig.from_target_config(
        tiny_target.config, num_layers=2, block_size=BLOCK, mask_token_id=511, gamma=4.0
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).bind_target(*target_parts(tiny_target))
    samples = synthetic_samples(
        tiny_target, num_samples=4, prompt_len=6, response_len=26, seed=5, max_token_id=500
    )
    batch = collate(samples, 32, 4, 0)
    context = target_context(
        tiny_target, batch.input_ids, batch.attention_mask, cfg.target_layer_ids
    )
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=5e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        anchors, valid = sample_anchors(batch.loss_mask, BLOCK, 6, gen)
        loss, _ = drafter_loss(
            drafter, context, batch.input_ids, anchors, valid, loss_mask=batch.loss_mask
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval(), context, batch


@torch.no_grad()
def _reference_dense_acceptance(drafter, context, input_ids, loss_mask, chunk=64):
    """The walk's lengths as they were first computed: every chunk of anchors a whole
    training forward (context keys recomputed, the full context masked), on the rows
    padded by B - 1 so that every token can be an anchor; a block commits no more than
    the answer has left (counted here one position at a time)."""
    block = drafter.cfg.block_size
    n, count = input_ids.shape
    input_ids = torch.nn.functional.pad(input_ids, (0, block - 1))
    mask = torch.nn.functional.pad(loss_mask.to(torch.bool), (0, block - 1))
    context = torch.nn.functional.pad(context, (0, 0, 0, block - 1))
    left = torch.zeros(n, count, dtype=torch.long)
    for row in range(n):
        run = 0
        for p in range(mask.shape[1] - 2, -1, -1):
            run = run + 1 if mask[row, p + 1] else 0
            if p < count:
                left[row, p] = run
    every = torch.arange(count).expand(n, count)
    answer = mask[:, :count] & mask[:, 1 : count + 1]
    lengths = torch.zeros(n, count, dtype=torch.long)
    for start in range(0, count, chunk):
        anchors = every[:, start : start + chunk].contiguous()
        valid = answer[:, start : start + chunk].contiguous()
        if not bool(valid.any()):
            continue
        hidden = drafter_block_hidden(
            drafter, context, input_ids, anchors, valid, attention="sdpa_dense"
        )
        guess = drafter.logits(hidden[:, :, 1:]).argmax(-1)
        labels, counts = block_labels(input_ids, anchors, valid, block, mask)
        prefix = torch.cumprod(((guess == labels) & counts).long(), dim=2).sum(2)
        committed = torch.minimum(1 + prefix, left[:, start : start + chunk])
        lengths[:, start : start + chunk] = torch.where(valid, committed, 0)
    return lengths


def test_the_cheaper_walk_gives_the_same_lengths_as_before(trained):
    drafter, context, batch = trained
    before = _reference_dense_acceptance(drafter, context, batch.input_ids, batch.loss_mask)
    assert int((before > 1).sum()) > 5  # the drafter accepts something: a real check
    for chunk, head_chunk in ((256, 64), (7, 3), (16, 16)):
        after = dense_acceptance(
            drafter,
            context,
            batch.input_ids,
            batch.loss_mask,
            chunk=chunk,
            head_chunk=head_chunk,
        )
        assert torch.equal(after, before), (chunk, head_chunk)


def test_the_training_steps_shares_are_the_walks_lengths_at_its_anchors(trained):
    """first_miss and full_accept of drafter_loss count what the walk's lengths say at the
    same anchors, so the step line's tau~ is `anchor_tau` of those anchors."""
    drafter, context, batch = trained
    lengths = dense_acceptance(drafter, context, batch.input_ids, batch.loss_mask)
    anchors, valid = sample_anchors(batch.loss_mask, BLOCK, 6, torch.Generator().manual_seed(9))
    _, metrics = drafter_loss(
        drafter, context, batch.input_ids, anchors, valid, loss_mask=batch.loss_mask
    )
    at_anchors = torch.where(valid, lengths.gather(1, anchors.clamp(max=lengths.shape[1] - 1)), 0)
    expected = anchor_tau(at_anchors.flatten().tolist(), BLOCK)
    share = blocks_per_token(float(metrics["first_miss"]), float(metrics["full_accept"]), BLOCK)
    assert 1 / share == pytest.approx(expected, rel=1e-6)
    # and the estimate is near the exact walk over the same rows (within 25% on these few anchors)
    assert expected == pytest.approx(
        walk_tau(drafter, context, batch.input_ids, batch.loss_mask, rows=4), rel=0.25
    )
