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


# -- sdpa_chunked: the same rule over less of the context -------------------------------------
def test_chunk_plan_bounds_every_sampled_anchor():
    """Right-aligned, every anchor the sampler can draw lies within its chunk's keys."""
    from dflash.masks import chunk_plan, right_align
    from dflash.objective import sample_anchors

    seq_len, block, num_anchors = 96, 4, 20
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        loss_mask = torch.rand(2, seq_len, generator=gen) < (0.3 + 0.7 * (trial % 3) / 2)
        anchors, valid = sample_anchors(loss_mask, block, num_anchors, gen)
        to_aligned, restore = right_align(valid)
        a, v = anchors.gather(1, to_aligned), valid.gather(1, to_aligned)
        assert torch.equal(a.gather(1, restore), anchors)  # the permutation round-trips
        for lo, hi, keys in chunk_plan(num_anchors, seq_len, block, 3):
            assert ((a[:, lo:hi] <= keys) | ~v[:, lo:hi]).all(), (trial, lo, hi, keys)


def test_chunk_plan_shrinks_the_work_at_the_recipe_shape():
    from dflash.masks import chunk_plan

    plan = chunk_plan(512, 8192, 16, 32)
    assert len(plan) == 16 and plan[0] == (0, 32, 496) and plan[-1] == (480, 512, 8176)
    chunked = sum((hi - lo) * 16 * (keys + (hi - lo) * 16) for lo, hi, keys in plan)
    dense = 512 * 16 * (8192 + 512 * 16)
    assert dense / chunked > 3.3


@pytest.mark.parametrize("chunk", [1, 2, 3, 8])
def test_chunked_backend_matches_dense_forward_and_backward(
    tiny_target, make_drafter, tiny_cfg, chunk
):
    from dflash.objective import drafter_loss, sample_anchors

    block = tiny_cfg.block_size
    gen = torch.Generator().manual_seed(chunk)
    ids = torch.randint(0, 500, (3, 48), generator=gen)
    context = target_context(tiny_target, ids, None, tiny_cfg.target_layer_ids)
    loss_mask = torch.ones(3, 48, dtype=torch.bool)
    loss_mask[1, :20] = False  # fewer anchors fit: padding slots in the middle row
    loss_mask[2, ::3] = False
    doc_ids = torch.zeros(3, 48, dtype=torch.long)
    doc_ids[2, 25:] = 1
    anchors, valid = sample_anchors(loss_mask, block, 9, gen, doc_ids)
    assert not valid[1].all()  # the case the right-alignment exists for
    results = {}
    for backend in ("sdpa_dense", "sdpa_chunked"):
        drafter = make_drafter(seed=5)
        loss, metrics = drafter_loss(
            drafter,
            context,
            ids,
            anchors,
            valid,
            attention=backend,
            attention_chunk=chunk,
            loss_mask=loss_mask,
            doc_ids=doc_ids,
            loss_chunk=4,
        )
        loss.backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
        results[backend] = (loss.detach(), metrics["acc"], grads)
    dense, chunked = results["sdpa_dense"], results["sdpa_chunked"]
    torch.testing.assert_close(chunked[0], dense[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked[1], dense[1])
    for name, grad in dense[2].items():
        torch.testing.assert_close(chunked[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_chunked_backend_refuses_a_layout_its_plan_does_not_cover(make_drafter, tiny_cfg):
    from dflash.objective import drafter_block_hidden

    drafter = make_drafter()
    ids = torch.randint(0, 500, (1, 32))
    context = torch.randn(1, 32, tiny_cfg.num_context_layers * tiny_cfg.hidden_size)
    anchors = torch.tensor([[24, 4, 28]])  # not sorted: slot 0 at 24 > 32 - 3 * 4
    valid = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="sdpa_chunked needs sorted anchors"):
        drafter_block_hidden(drafter, context, ids, anchors, valid, attention="sdpa_chunked")
