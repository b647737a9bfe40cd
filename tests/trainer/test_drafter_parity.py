"""The training forward for an anchor gives the same logits as the cached inference forward.

This is the test that catches the shifted-label and `<= anchor` bugs: both make
training see something inference never sees, and the logits part ways.
"""

from __future__ import annotations

import pytest
import torch
from dflash.masks import dense_block_mask, sdpa_attend
from dflash.objective import block_input_ids, block_slots, drafter_block_hidden
from dflash.spec_decode import DrafterCache, draft_block_logits
from dflash.target import cached_forward, new_cache, select_layers, target_context


@pytest.fixture()
def batch(tiny_target, tiny_cfg):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 500, (2, 48), generator=gen)
    context = target_context(tiny_target, ids, None, tiny_cfg.target_layer_ids)
    anchors = torch.tensor([[1, 9, 17, 30, 0], [4, 12, 22, 40, 0]])
    valid = torch.tensor([[True] * 4 + [False], [True] * 4 + [False]])
    return ids, context, anchors, valid


def _inference_logits(drafter, context_row, ids_row, anchor, chunks=2):
    """Feed the context before `anchor` into the drafter cache in pieces, then draft one block."""
    cache = DrafterCache()
    cuts = torch.linspace(0, anchor, chunks + 1).long().tolist()
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        if hi > lo:
            cache.extend(drafter, context_row[None, lo:hi])
    return draft_block_logits(drafter, cache, int(ids_row[anchor]))[0]


def test_training_forward_equals_cached_inference(make_drafter, batch):
    drafter = make_drafter(seed=3).eval()
    ids, context, anchors, valid = batch
    with torch.no_grad():
        train = drafter.logits(drafter_block_hidden(drafter, context, ids, anchors, valid))
    for row in range(2):
        for a in range(4):
            anchor = int(anchors[row, a])
            infer = _inference_logits(drafter, context[row], ids[row], anchor)
            torch.testing.assert_close(train[row, a], infer, atol=2e-5, rtol=1e-5)


def test_context_from_the_targets_own_cache_matches(tiny_target, make_drafter, tiny_cfg, batch):
    """Hidden states from a cached prefill (as decoding sees them) give the training logits too."""
    drafter = make_drafter(seed=4).eval()
    ids, context, anchors, valid = batch
    anchor = int(anchors[0, 2])
    with torch.no_grad():
        train = drafter.logits(drafter_block_hidden(drafter, context, ids, anchors, valid))[0, 2]
        out = cached_forward(tiny_target, ids[:1, :anchor], 0, new_cache(tiny_target), hidden=True)
        cache = DrafterCache()
        cache.extend(drafter, select_layers(out.hidden_states, tiny_cfg.target_layer_ids))
        infer = draft_block_logits(drafter, cache, int(ids[0, anchor]))[0]
    torch.testing.assert_close(train, infer, atol=1e-4, rtol=1e-4)
    # The drafter's proposals for slots 1..B-1 are what the labels ask for at anchor+1..anchor+B-1.
    assert torch.equal(train.argmax(-1), infer.argmax(-1))


def test_parity_catches_a_mask_that_shows_the_anchor(make_drafter, tiny_cfg, batch):
    """A `<= anchor` mask (the bug others shipped) must break parity, or the test is toothless."""
    drafter = make_drafter(seed=3).eval()
    ids, context, anchors, valid = batch
    n, seq_len = ids.shape
    leaky = dense_block_mask(
        anchors + 1, valid, seq_len, tiny_cfg.block_size
    )  # context j <= anchor
    with torch.no_grad():
        fused = drafter.fuse(context)
        ctx_kv = drafter.context_kv(fused, torch.arange(seq_len).expand(n, -1))
        blocks = block_input_ids(ids, anchors, tiny_cfg.block_size, tiny_cfg.mask_token_id).flatten(
            1
        )
        positions = block_slots(anchors, tiny_cfg.block_size).flatten(1)
        hidden = drafter(drafter.embed_blocks(blocks), positions, ctx_kv, sdpa_attend(leaky))
        leaky_logits = drafter.logits(hidden).view(n, anchors.shape[1], tiny_cfg.block_size, -1)
    infer = _inference_logits(drafter, context[0], ids[0], int(anchors[0, 1]))
    assert (leaky_logits[0, 1] - infer).abs().max() > 1e-3
