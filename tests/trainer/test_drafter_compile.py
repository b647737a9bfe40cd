"""drafter_loss traces as one graph, forward and backward: no host syncs, no data-dependent shapes."""

from __future__ import annotations

import pytest
import torch
from dflash import drafter_loss, sample_anchors
from dflash.target import target_context


@pytest.mark.parametrize("attention", ["sdpa_dense", "sdpa_chunked"])
def test_loss_compiles_as_one_graph_and_matches_eager(
    tiny_target, make_drafter, tiny_cfg, attention
):
    drafter = make_drafter(seed=2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (2, 32), generator=gen)
    loss_mask = torch.ones(2, 32, dtype=torch.bool)
    context = target_context(tiny_target, ids, None, tiny_cfg.target_layer_ids)
    anchors, valid = sample_anchors(loss_mask, tiny_cfg.block_size, 6, gen)

    def step(context, ids, anchors, valid, loss_mask):
        return drafter_loss(
            drafter,
            context,
            ids,
            anchors,
            valid,
            loss_chunk=2,
            loss_mask=loss_mask,
            attention=attention,
            attention_chunk=2,
        )

    eager_loss, eager_metrics = step(context, ids, anchors, valid, loss_mask)
    eager_loss.backward()
    eager_grads = [p.grad.clone() for p in drafter.parameters()]
    drafter.zero_grad(set_to_none=True)

    # fullgraph=True fails on any graph break (.item(), data-dependent shapes, Python branches
    # on tensor values); aot_eager also traces the backward of the chunked loss.
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss, metrics = compiled(context, ids, anchors, valid, loss_mask)
    loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    torch.testing.assert_close(metrics["per_slot_acc"], eager_metrics["per_slot_acc"])
    for p, expected in zip(drafter.parameters(), eager_grads, strict=True):
        torch.testing.assert_close(p.grad, expected)
