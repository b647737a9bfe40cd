"""The training attention mask: strict `< anchor`, no cross-block visibility, invalid blocks masked."""

from __future__ import annotations

import pytest
import torch
from dflash.masks import dense_block_mask
from dflash.objective import drafter_block_hidden
from dflash.target import target_context

S, B = 24, 4


def _mask(anchors, valid, doc_ids=None):
    return dense_block_mask(
        torch.tensor(anchors),
        torch.tensor(valid),
        S,
        B,
        None if doc_ids is None else torch.tensor(doc_ids),
    )[:, 0]


def test_context_is_strictly_before_the_anchor():
    mask = _mask([[5, 13]], [[True, True]])
    for block, anchor in enumerate([5, 13]):
        rows = mask[0, block * B : (block + 1) * B, :S]
        expected = torch.arange(S) < anchor
        assert torch.equal(rows, expected.expand(B, S)), f"block {block} context row"
        # The anchor's own position is the `<=` bug: it must stay hidden.
        assert not rows[:, anchor].any()


def test_blocks_see_themselves_fully_and_no_other_block():
    mask = _mask([[2, 9, 16]], [[True, True, True]])
    block_part = mask[0, :, S:]
    owner = torch.arange(3 * B) // B
    assert torch.equal(block_part, owner[:, None] == owner[None, :])


def test_invalid_blocks_see_no_context_and_are_unseen():
    mask = _mask([[6, 0]], [[True, False]])
    invalid_rows = mask[0, B:, :]
    assert not invalid_rows[:, :S].any()
    assert invalid_rows[:, S + B :].all()  # only itself, so no row is fully masked
    assert not mask[0, :B, S + B :].any()  # the valid block never sees the invalid one


def test_packed_documents_hide_other_documents_context():
    doc_ids = [[0] * 10 + [1] * 14]
    mask = _mask([[4, 15]], [[True, True]], doc_ids)
    assert torch.equal(mask[0, 0, :S], torch.arange(S) < 4)
    second = mask[0, B, :S]
    assert torch.equal(second, (torch.arange(S) >= 10) & (torch.arange(S) < 15))


# Eager flex on CPU is the unfused reference path (what this test wants); it warns so.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backend_matches_dense(tiny_target, make_drafter, tiny_cfg):
    drafter = make_drafter().eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 500, (2, 32), generator=gen)
    context = target_context(tiny_target, ids, None, tiny_cfg.target_layer_ids)
    anchors = torch.tensor([[3, 12, 20, 0], [5, 9, 27, 0]])
    valid = torch.tensor([[True, True, True, False], [True, True, True, False]])
    doc_ids = torch.zeros(2, 32, dtype=torch.long)
    doc_ids[:, 8:] = 1
    with torch.no_grad():  # flex has no CPU backward; the forward is what must agree
        dense = drafter_block_hidden(drafter, context, ids, anchors, valid, doc_ids=doc_ids)
        flex = drafter_block_hidden(
            drafter, context, ids, anchors, valid, attention="flex", doc_ids=doc_ids
        )
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
