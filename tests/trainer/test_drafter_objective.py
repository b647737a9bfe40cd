"""Anchors, labels, weights, the chunked loss and the metrics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dflash import expected_acceptance_length, sample_anchors
from dflash.chunked_ce import chunked_linear_cross_entropy
from dflash.config import select_target_layers
from dflash.objective import (
    block_input_ids,
    block_labels,
    drafter_block_hidden,
    drafter_loss,
    slot_weights,
)
from dflash.target import target_context


def test_published_target_layers():
    assert select_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert select_target_layers(6, 2) == [1, 3]
    assert select_target_layers(36, 1) == [18]


@pytest.mark.parametrize("seed", range(5))
def test_anchors_follow_the_rules(seed):
    gen = torch.Generator().manual_seed(seed)
    seq_len, block, num_anchors = 96, 4, 12
    loss_mask = torch.rand(3, seq_len, generator=gen) < 0.6
    doc_ids = torch.cumsum(torch.rand(3, seq_len, generator=gen) < 0.05, dim=1)
    anchors, valid = sample_anchors(loss_mask, block, num_anchors, gen, doc_ids=doc_ids)
    assert anchors.shape == valid.shape == (3, num_anchors)
    for row in range(3):
        chosen = anchors[row][valid[row]].tolist()
        assert chosen == sorted(chosen) and len(chosen) > 0
        assert all(loss_mask[row, p] for p in chosen)
        assert all(p <= seq_len - block for p in chosen)
        assert all(doc_ids[row, p] == doc_ids[row, p + block - 1] for p in chosen)
        assert all(b - a >= block for a, b in zip(chosen, chosen[1:], strict=False))
        assert (anchors[row][~valid[row]] == 0).all()
        # Valid anchors come first, padding after.
        assert valid[row].tolist() == sorted(valid[row].tolist(), reverse=True)


def test_anchors_are_capped_and_reproducible():
    loss_mask = torch.ones(1, 64, dtype=torch.bool)
    first = sample_anchors(loss_mask, 4, 100, torch.Generator().manual_seed(3))
    second = sample_anchors(loss_mask, 4, 100, torch.Generator().manual_seed(3))
    assert torch.equal(first[0], second[0])
    assert int(first[1].sum()) == 16  # as many as fit: positions 0..60, one per B
    none, valid = sample_anchors(torch.zeros(1, 64, dtype=torch.bool), 4, 5, torch.Generator())
    assert not valid.any()


def test_blocks_and_labels_are_aligned():
    ids = torch.arange(100, 130)[None]
    anchors = torch.tensor([[3, 10, 26]])
    valid = torch.tensor([[True, True, False]])
    blocks = block_input_ids(ids, anchors, 4, mask_token_id=7)
    assert blocks[0, 0].tolist() == [103, 7, 7, 7]
    assert blocks[0, 1].tolist() == [110, 7, 7, 7]
    labels, counts = block_labels(ids, anchors, valid, 4)
    assert labels[0, 0].tolist() == [104, 105, 106]  # slot k predicts token[anchor + k]
    assert labels[0, 1].tolist() == [111, 112, 113]
    assert counts[0, :2].all() and not counts[0, 2].any()
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[0, 12:] = False
    _, counts = block_labels(ids, anchors, valid, 4, loss_mask)
    assert counts[0, 1].tolist() == [True, False, False]


def test_slot_weights_decay_with_gamma():
    w = slot_weights(5, gamma=4.0)
    assert torch.allclose(w, torch.tensor([math.exp(-k / 4.0) for k in range(4)]))


@pytest.mark.parametrize("chunk_rows", [1, 5, 64])
def test_chunked_cross_entropy_matches_full_logits(chunk_rows):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 50, (23,), generator=gen)
    row_weights = torch.rand(23, generator=gen, dtype=torch.float64)
    loss, correct = chunked_linear_cross_entropy(hidden, weight, labels, row_weights, chunk_rows)
    (grad,) = torch.autograd.grad(3.0 * loss, hidden)

    reference_hidden = hidden.detach().clone().requires_grad_(True)
    logits = reference_hidden @ weight.t()
    reference = (F.cross_entropy(logits, labels, reduction="none") * row_weights).sum()
    (reference_grad,) = torch.autograd.grad(3.0 * reference, reference_hidden)
    torch.testing.assert_close(loss.double(), reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-6, atol=1e-9)
    assert torch.equal(correct, logits.argmax(-1) == labels)


def test_loss_and_metrics_match_a_direct_computation(tiny_target, make_drafter, tiny_cfg):
    drafter = make_drafter()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 500, (2, 40), generator=gen)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, :6] = False
    context = target_context(tiny_target, ids, None, tiny_cfg.target_layer_ids)
    anchors, valid = sample_anchors(loss_mask, 4, 6, gen)
    valid[1, -1] = False  # one padded block
    loss, metrics = drafter_loss(
        drafter, context, ids, anchors, valid, loss_chunk=2, loss_mask=loss_mask
    )

    hidden = drafter_block_hidden(drafter, context, ids, anchors, valid)
    logits = drafter.logits(hidden[:, :, 1:])
    labels, counts = block_labels(ids, anchors, valid, 4, loss_mask)
    w = slot_weights(4, 4.0) * counts
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(w)
    torch.testing.assert_close(loss, (ce * w).sum() / w.sum(), rtol=1e-5, atol=1e-6)

    right = (logits.argmax(-1) == labels) & counts
    torch.testing.assert_close(
        metrics["per_slot_acc"], right.float().sum((0, 1)) / counts.float().sum((0, 1))
    )
    prefix = torch.cumprod(right.long(), 2).sum(2).float()
    torch.testing.assert_close(metrics["accept_len"], 1 + prefix[valid].mean())
    assert metrics["num_blocks"] == valid.sum()
    loss.backward()
    assert drafter.fc.weight.grad is not None and tiny_target.lm_head.weight.grad is None


def test_expected_acceptance_length():
    assert expected_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_acceptance_length(torch.tensor([0.5, 0.5])) == pytest.approx(1.75)
    assert expected_acceptance_length([0.0, 1.0]) == 1.0


def test_anchor_layouts_vary_and_reach_every_position():
    loss_mask = torch.ones(1, 64, dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)
    seen = torch.zeros(64, dtype=torch.long)
    layouts = set()
    for _ in range(200):
        anchors, valid = sample_anchors(loss_mask, 4, 8, gen)
        assert int(valid.sum()) == 8
        seen[anchors[valid]] += 1
        layouts.add(tuple(anchors[0].tolist()))
    assert (seen[:61] > 0).all() and (seen[61:] == 0).all()
    assert len(layouts) > 150


def test_blocks_of_different_documents_may_sit_close():
    loss_mask = torch.ones(1, 16, dtype=torch.bool)
    doc_ids = torch.tensor([[0] * 6 + [1] * 10])
    anchors, valid = sample_anchors(loss_mask, 4, 10, torch.Generator().manual_seed(1), doc_ids)
    chosen = anchors[valid].tolist()
    # Document 0 holds anchors 0..2 (one fits), document 1 anchors 6..12 (two fit).
    assert len(chosen) == 3 and chosen[0] <= 2 and chosen[1] >= 6
