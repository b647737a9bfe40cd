"""AdamW with fp32 master weights, cosine schedule with warm-up, clipping, warm-up snapshots."""

from __future__ import annotations

import math

import pytest
import torch
from dflash.pipeline.optim import CosineWithWarmup, MasterWeightAdamW
from dflash.pipeline.train_config import OptimSection


def test_cosine_schedule_with_warmup():
    sched = CosineWithWarmup(peak_lr=1e-3, total_steps=100, warmup_ratio=0.04, min_lr_ratio=0.1)
    assert sched.warmup_steps == 4
    assert [sched.lr_at(s) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert sched.lr_at(4) == pytest.approx(1e-3)
    assert sched.lr_at(52) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert sched.lr_at(100) == pytest.approx(1e-4)
    values = [sched.lr_at(s) for s in range(4, 101)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_bf16_model_updates_through_fp32_masters():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8).to(torch.bfloat16)
    before = [p.detach().clone() for p in layer.parameters()]
    opt = MasterWeightAdamW(
        layer.parameters(), OptimSection(lr=1e-4, warmup_ratio=0.0), total_steps=1000
    )
    assert opt.uses_master and all(m.dtype == torch.float32 for m in opt.masters)
    pointers = [p.data_ptr() for p in layer.parameters()]
    for _ in range(3):
        layer(torch.randn(4, 8, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.set_master_grads(opt.model_grads())
        opt.step()
    # Three steps of ~1e-4 are below bf16 resolution for most weights, but the masters keep them.
    drift = max(
        (m - b.float()).abs().max().item() for m, b in zip(opt.masters, before, strict=False)
    )
    assert drift > 2e-4
    for p, m in zip(layer.parameters(), opt.masters, strict=False):
        assert torch.equal(p, m.to(torch.bfloat16))
    assert [p.data_ptr() for p in layer.parameters()] == pointers  # updated in place
    assert all(p.grad is None for p in layer.parameters())


def test_gradients_are_clipped_to_the_configured_norm():
    weight = torch.nn.Parameter(torch.zeros(4))
    opt = MasterWeightAdamW([weight], OptimSection(lr=0.0, grad_clip=1.0), total_steps=10)
    weight.grad = torch.full((4,), 10.0)
    norm = opt.step()
    assert norm == pytest.approx(20.0)


def test_snapshot_and_restore_undo_warmup_steps_in_place():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    opt = MasterWeightAdamW(layer.parameters(), OptimSection(lr=0.1), total_steps=10)
    before = [p.detach().clone() for p in layer.parameters()]
    pointers = [p.data_ptr() for p in layer.parameters()]
    snap = opt.snapshot()
    for _ in range(2):
        layer(torch.randn(2, 4)).sum().backward()
        opt.set_master_grads(opt.model_grads())
        opt.step()
    assert not torch.equal(next(layer.parameters()), before[0])
    opt.restore(snap)
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before, strict=False))
    assert [p.data_ptr() for p in layer.parameters()] == pointers
    assert opt.scheduler.last_step == 0 and not opt.optimizer.state


def test_skipped_step_keeps_weights_and_advances_the_schedule():
    weight = torch.nn.Parameter(torch.ones(3))
    opt = MasterWeightAdamW([weight], OptimSection(lr=0.1, warmup_ratio=0.5), total_steps=4)
    weight.grad = torch.full((3,), math.nan)
    opt.skip_step()
    assert torch.equal(weight, torch.ones(3)) and weight.grad is None
    assert opt.scheduler.last_step == 1
