"""The DFlash training objective: anchors, blocks, labels, weights, loss, metrics.

For each sequence, anchors are positions where the loss mask is on. Block a is
[token[anchor_a], MASK x (B-1)] at positions anchor_a + k; slot k >= 1 predicts
token[anchor_a + k] (slot 0 is the given token and has no loss), weighted by
exp(-(k-1)/gamma), normalised over the valid labels of the batch.

`sample_anchors` is data-dependent and runs outside any compiled region; it
returns static shapes. `drafter_loss` is static-shaped and free of host syncs
(no .item(), no data-dependent shapes or Python branches on tensor values), so
it can run under torch.compile(mode="reduce-overhead").
"""

from __future__ import annotations

import math

import torch

from dflash.pipeline.train_config import ATTENTION_BACKENDS

from .chunked_ce import chunked_linear_cross_entropy
from .masks import (
    chunked_sdpa_attend,
    dense_block_mask,
    flex_attend,
    flex_block_mask,
    right_align,
    sdpa_attend,
)
from .model import DFlashDrafter


# -- anchors ---------------------------------------------------------------------------------
def sample_anchors(
    loss_mask: torch.Tensor,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator | None = None,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors per sequence -> (anchors [N, A] long, valid [N, A] bool).

    An anchor p has loss_mask[p] on, p <= S - B, its whole block inside one
    document (doc_ids[p] == doc_ids[p + B - 1]), and no other anchor closer than
    B. As many anchors as fit (up to A) are taken, uniformly at random among the
    layouts that respect the spacing, so few blocks are wasted as padding.
    Anchors are sorted; unused slots hold 0 with valid False. `generator` is a
    CPU torch.Generator; outputs are on loss_mask's device.
    """
    if block_size < 2 or num_anchors < 1:
        raise ValueError(
            f"need block_size >= 2 and num_anchors >= 1, got {block_size}, {num_anchors}"
        )
    device = loss_mask.device
    mask = loss_mask.detach().to("cpu", torch.bool)
    n, seq_len = mask.shape
    anchors = torch.zeros(n, num_anchors, dtype=torch.long)
    valid = torch.zeros(n, num_anchors, dtype=torch.bool)
    last = seq_len - block_size  # largest allowed anchor
    if last < 0:
        return anchors.to(device), valid.to(device)
    eligible = mask[:, : last + 1].clone()
    docs = (
        doc_ids.detach().to("cpu")
        if doc_ids is not None
        else torch.zeros(n, seq_len, dtype=torch.long)
    )
    eligible &= docs[:, : last + 1] == docs[:, block_size - 1 :]
    for row in range(n):
        runs = _spaced_runs(eligible[row].nonzero()[:, 0].tolist(), docs[row].tolist(), block_size)
        chosen = _place_anchors(runs, block_size, num_anchors, generator)
        anchors[row, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
        valid[row, : len(chosen)] = True
    return anchors.to(device), valid.to(device)


def _spaced_runs(positions: list[int], docs: list[int], block_size: int) -> list[tuple[int, int]]:
    """Maximal runs [lo, hi] of consecutive eligible positions in one document, trimmed so
    that any anchor of one run is at least B from any anchor of the previous run."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and p == runs[-1][1] + 1 and docs[p] == docs[runs[-1][1]]:
            runs[-1] = (runs[-1][0], p)
            continue
        if runs and docs[p] == docs[runs[-1][1]] and p < runs[-1][1] + block_size:
            continue  # too close to the previous run's end: the next run starts later
        runs.append((p, p))
    return runs


def _place_anchors(runs, block_size, num_anchors, generator) -> list[int]:
    """Up to num_anchors anchors spaced >= B: counts per run drawn over the runs' capacity
    slots, then within a run a uniform layout (stars and bars)."""
    capacity = [(hi - lo) // block_size + 1 for lo, hi in runs]
    total = sum(capacity)
    if total == 0:
        return []
    take = min(num_anchors, total)
    picked = torch.randperm(total, generator=generator)[:take]
    owner = torch.repeat_interleave(torch.arange(len(runs)), torch.tensor(capacity))
    counts = torch.bincount(owner[picked], minlength=len(runs)).tolist()
    chosen: list[int] = []
    for (lo, hi), k in zip(runs, counts, strict=True):
        if k == 0:
            continue
        free = (hi - lo + 1) - (k - 1) * (block_size - 1)  # positions left after the spacing
        offsets = torch.randperm(free, generator=generator)[:k].sort().values.tolist()
        chosen.extend(lo + o + i * (block_size - 1) for i, o in enumerate(offsets))
    return chosen


# -- blocks, labels, weights -----------------------------------------------------------------
def block_slots(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Positions anchor + k, [N, A, B]."""
    return anchors[:, :, None] + torch.arange(block_size, device=anchors.device)


def block_input_ids(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> torch.Tensor:
    """[token[anchor], MASK, ..., MASK] per block, [N, A, B]."""
    n, num_anchors = anchors.shape
    ids = torch.full(
        (n, num_anchors, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device
    )
    ids[:, :, 0] = input_ids.gather(1, anchors)
    return ids


def block_labels(
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels token[anchor + k] for slots k = 1..B-1, and which of them count: ([N, A, B-1], bool)."""
    seq_len = input_ids.shape[1]
    pos = block_slots(anchors, block_size)[:, :, 1:].clamp(max=seq_len - 1)
    flat = pos.flatten(1)
    labels = input_ids.gather(1, flat).view_as(pos)
    counts = anchor_valid[:, :, None] & (
        anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device) < seq_len
    )
    if loss_mask is not None:
        counts = counts & loss_mask.to(torch.bool).gather(1, flat).view_as(pos)
    return labels, counts


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """exp(-(k-1)/gamma) for k = 1..B-1 (unnormalised; the loss divides by the valid sum)."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


# -- the drafter over all blocks at once -----------------------------------------------------
def drafter_block_hidden(
    drafter: DFlashDrafter,
    context: torch.Tensor,
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    *,
    attention: str = "sdpa_dense",
    doc_ids: torch.Tensor | None = None,
    attention_chunk: int = 32,
) -> torch.Tensor:
    """Final hidden states of every block row, [N, A, B, H], in one forward.

    `attention_chunk`: anchors per chunk for "sdpa_chunked" (see masks.py)."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
    cfg = drafter.cfg
    n, seq_len = input_ids.shape
    num_anchors, block = anchors.shape[1], cfg.block_size
    restore = None
    if attention == "sdpa_chunked":
        # Blocks are independent given their anchors, so their order is free: put the
        # valid ones last, where the chunk plan's static bounds hold, and undo it after.
        to_aligned, restore = right_align(anchor_valid)
        anchors, anchor_valid = anchors.gather(1, to_aligned), anchor_valid.gather(1, to_aligned)
    fused = drafter.fuse(context)
    ctx_pos = torch.arange(seq_len, device=input_ids.device).expand(n, -1)
    ctx_kv = drafter.context_kv(fused, ctx_pos)
    block_ids = block_input_ids(input_ids, anchors, block, cfg.mask_token_id).flatten(1)
    positions = block_slots(anchors, block).flatten(1)
    if attention == "flex":
        attend = flex_attend(flex_block_mask(anchors, anchor_valid, seq_len, block, doc_ids))
    elif attention == "sdpa_chunked":
        attend = chunked_sdpa_attend(
            anchors, anchor_valid, seq_len, block, attention_chunk, doc_ids
        )
    else:
        attend = sdpa_attend(dense_block_mask(anchors, anchor_valid, seq_len, block, doc_ids))
    hidden = drafter(drafter.embed_blocks(block_ids), positions, ctx_kv, attend)
    hidden = hidden.view(n, num_anchors, block, -1)
    if restore is not None:
        index = restore[:, :, None, None].expand(-1, -1, block, hidden.shape[-1])
        hidden = hidden.gather(1, index)
    return hidden


def drafter_loss(
    drafter: DFlashDrafter,
    context: torch.Tensor,
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    *,
    loss_chunk: int = 64,
    attention: str = "sdpa_dense",
    attention_chunk: int = 32,
    loss_mask: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted block cross-entropy and detached metrics (all tensors, no host sync).

    context [N, S, k*H] from `target_context`; input_ids [N, S]; anchors/anchor_valid
    [N, A] from `sample_anchors`. `loss_chunk` is how many anchors' rows (x (B-1))
    go through the LM head at once. `loss_mask` (optional) drops labels outside it,
    e.g. past the end of an assistant turn. `attention`: "sdpa_dense" (any device),
    "sdpa_chunked" (any device, the same result with less work; `attention_chunk`
    anchors per chunk) or "flex" (GPU); see masks.py.

    metrics: loss, acc (over counted labels), per_slot_acc [B-1] (slots 1..B-1),
    accept_len (mean over valid blocks of 1 + matching prefix length, the
    teacher-forced acceptance length), num_blocks, num_labels, first_miss and
    full_accept (shares of the blocks with a token to draft that accept none / all of
    it: the serving estimate, serving_walk.anchor_tau).
    """
    cfg = drafter.cfg
    block = cfg.block_size
    hidden = drafter_block_hidden(
        drafter,
        context,
        input_ids,
        anchors,
        anchor_valid,
        attention=attention,
        doc_ids=doc_ids,
        attention_chunk=attention_chunk,
    )
    labels, counts = block_labels(input_ids, anchors, anchor_valid, block, loss_mask)
    weights = slot_weights(block, cfg.gamma, input_ids.device) * counts  # [N, A, B-1]
    row_weights = weights / weights.sum().clamp(min=1e-6)
    rows = hidden[:, :, 1:].reshape(-1, hidden.shape[-1])
    loss, correct = chunked_linear_cross_entropy(
        rows,
        drafter.lm_head.weight,
        labels.reshape(-1),
        row_weights.reshape(-1),
        loss_chunk * (block - 1),
    )
    correct = correct.view_as(counts) & counts
    countsf = counts.float()
    per_slot_acc = correct.float().sum((0, 1)) / countsf.sum((0, 1)).clamp(min=1.0)
    prefix = torch.cumprod(correct.long(), dim=2).sum(2).float()  # [N, A]
    validf = anchor_valid.float()
    num_blocks = validf.sum()
    # Blocks with a token to draft (an anchor at an answer's last token has none): what
    # the serving estimate counts (serving_walk.anchor_tau).
    drafting = (anchor_valid & counts[:, :, 0]).float()
    num_drafting = drafting.sum().clamp(min=1.0)
    metrics = {
        "loss": loss.detach(),
        "acc": correct.float().sum() / countsf.sum().clamp(min=1.0),
        "per_slot_acc": per_slot_acc,
        "accept_len": 1.0 + (prefix * validf).sum() / num_blocks.clamp(min=1.0),
        "num_blocks": num_blocks,
        "num_labels": countsf.sum(),
        # shares of drafting blocks whose first drafted token is wrong / that accept all
        "first_miss": ((prefix == 0).float() * drafting).sum() / num_drafting,
        "full_accept": ((prefix == block - 1).float() * drafting).sum() / num_drafting,
    }
    return loss, metrics


def expected_acceptance_length(per_slot_acc) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the acceptance length implied by per-slot accuracies.

    Treats slot accuracies as independent; the teacher-forced `accept_len` metric
    measures the prefix directly.
    """
    acc = [
        float(a) for a in (per_slot_acc.tolist() if torch.is_tensor(per_slot_acc) else per_slot_acc)
    ]
    total, run = 1.0, 1.0
    for a in acc:
        if not math.isfinite(a):
            return float("nan")
        run *= min(max(a, 0.0), 1.0)
        total += run
    return total
