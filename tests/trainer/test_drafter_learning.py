"""On the tiny setup the drafter learns: the loss falls and speculative decoding speeds up, losslessly."""

from __future__ import annotations

import math
import time

import pytest
import torch
from dflash import drafter_loss, sample_anchors
from dflash.data import iterate_batches, random_prompts, synthetic_samples
from dflash.spec_decode import evaluate
from dflash.target import target_context

STEPS, BATCH, LR = 200, 16, 1e-2


@pytest.mark.slow
@pytest.mark.timeout(900)  # 200 steps: about 60 s alone, several times that on a busy machine
def test_loss_falls_and_tau_rises(tiny_target, make_drafter, tiny_cfg):
    started = time.monotonic()
    samples = synthetic_samples(
        tiny_target, num_samples=512, prompt_len=8, response_len=48, seed=1, max_token_id=500
    )
    held_out = random_prompts(6, 8, max_token_id=500, seed=1234)
    drafter = make_drafter(seed=0)
    before = evaluate(drafter, tiny_target, held_out, max_new_tokens=48)

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / 30) * 0.5 * (1 + math.cos(math.pi * min(s, STEPS) / STEPS)),
    )
    generator = torch.Generator().manual_seed(0)
    losses: list[float] = []
    epoch = 0
    while len(losses) < STEPS:
        for batch in iterate_batches(samples, batch_size=BATCH, seq_lens=56, pad_id=0, epoch=epoch):
            context = target_context(
                tiny_target, batch.input_ids, batch.attention_mask, tiny_cfg.target_layer_ids
            )
            anchors, valid = sample_anchors(batch.loss_mask, tiny_cfg.block_size, 16, generator)
            loss, _ = drafter_loss(
                drafter,
                context,
                batch.input_ids,
                anchors,
                valid,
                loss_chunk=64,
                loss_mask=batch.loss_mask,
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if len(losses) == STEPS:
                break
        epoch += 1

    after = evaluate(drafter, tiny_target, held_out, max_new_tokens=48)
    first, last = sum(losses[:20]) / 20, sum(losses[-50:]) / 50
    print(
        f"loss {first:.2f} -> {last:.2f}; {before.format_line()} -> {after.format_line()}; "
        f"{time.monotonic() - started:.1f} s"
    )
    assert last < 0.8 * first
    assert before.lossless and after.lossless
    assert before.tau < 1.1
    assert after.tau > 1.2 and after.tokens_per_target_forward > 1.15
