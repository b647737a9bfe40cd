"""Which keys each block row may see, and the attention kernels that apply it.

Training lays out keys as [S context positions ; A blocks of B rows] and queries
as the A*B block rows. A row of block a sees:
  - context position j iff j < anchor_a (strictly: the anchor's own hidden state
    does not exist yet at inference time) and, with packed documents, j is in
    the anchor's document; an invalid (padding) block sees no context;
  - every row of its own block (bidirectional), and nothing of other blocks.

Backends (the `attention` option of `drafter_loss`):
  "sdpa_dense": a dense boolean mask [N, 1, A*B, S+A*B] with
                torch.nn.functional.scaled_dot_product_attention. Exact on any
                device; the one to use on CPU (flex has no CPU backward).
                Mask memory grows with A*B*(S+A*B).
  "sdpa_chunked": the same rule, exact, but the block rows go through SDPA in
                chunks of consecutive anchors, each against only the context
                prefix its anchors can reach plus its own blocks' keys. Needs
                the sampler's layout (sorted anchors spaced >= B, <= S - B);
                see `chunk_plan`. At 512 anchors x 16 over 8192 positions it
                does about 3.4x less attention work than "sdpa_dense".
  "flex":       torch.nn.attention.flex_attention with a BlockMask built from the
                same rule; skips fully masked tiles. On CUDA the kernel is
                compiled (once, or inside the caller's torch.compile region).
Measured on an H200 at the Qwen3-8B drafter shape (1.05B parameters, batch 1 x 3072
tokens, 192 anchors x 16, eager step): flex 87 ms forward+backward and +5.05 GiB,
sdpa_dense 86 ms and +5.57 GiB; flex's advantage grows with the sequence length.
At the recipe's 8192 tokens and 512 anchors: sdpa_chunked 286.9 ms vs sdpa_dense
290.0 ms eager (the per-chunk key/value copies eat the saving), but a 1.16x faster
whole training step under torch.compile, where inductor fuses them (bench/README.md).
All three trace with torch.compile(fullgraph=True).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .model import Attend


def _row_owner(num_anchors: int, block_size: int, device) -> torch.Tensor:
    return torch.arange(num_anchors * block_size, device=device) // block_size


def dense_block_mask(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    seq_len: int,
    block_size: int,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask [N, 1, A*B, S + A*B]; True = may attend.

    The keys are the first `seq_len` context positions (a prefix of the sequence:
    `doc_ids` may be longer) followed by the A blocks' rows."""
    n, num_anchors = anchors.shape
    owner = _row_owner(num_anchors, block_size, anchors.device)  # [Q]
    row_anchor = anchors[:, owner]  # [N, Q]
    row_valid = anchor_valid[:, owner]
    ctx = torch.arange(seq_len, device=anchors.device)
    sees_ctx = (ctx[None, None, :] < row_anchor[:, :, None]) & row_valid[:, :, None]
    if doc_ids is not None:
        anchor_doc = doc_ids.gather(1, anchors)[:, owner]  # [N, Q]
        sees_ctx = sees_ctx & (doc_ids[:, None, :seq_len] == anchor_doc[:, :, None])
    sees_block = (owner[:, None] == owner[None, :]).expand(n, -1, -1)
    return torch.cat([sees_ctx, sees_block], dim=2)[:, None]


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def sdpa_attend(mask: torch.Tensor | None) -> Attend:
    """SDPA with an optional dense boolean mask (None = every key visible)."""

    def attend(q, k, v):
        groups = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q, _repeat_kv(k, groups), _repeat_kv(v, groups), attn_mask=mask
        )

    return attend


def flex_block_mask(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    seq_len: int,
    block_size: int,
    doc_ids: torch.Tensor | None = None,
):
    """The same rule as `dense_block_mask` as a flex-attention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    n, num_anchors = anchors.shape
    num_rows = num_anchors * block_size
    anchor_doc = doc_ids.gather(1, anchors) if doc_ids is not None else None

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        anchor = anchors[b, block]
        in_context = kv_idx < seq_len
        ctx_kv = torch.clamp(kv_idx, max=seq_len - 1)
        sees_ctx = (kv_idx < anchor) & anchor_valid[b, block]
        if anchor_doc is not None:
            sees_ctx = sees_ctx & (doc_ids[b, ctx_kv] == anchor_doc[b, block])
        sees_block = (kv_idx - seq_len) // block_size == block
        return torch.where(in_context, sees_ctx, sees_block)

    return create_block_mask(
        mask_mod, B=n, H=None, Q_LEN=num_rows, KV_LEN=seq_len + num_rows, device=anchors.device
    )


_compiled_flex = None


def _flex_kernel(on_cuda: bool):
    """flex_attention compiled once for CUDA (eager flex is a slow reference path);
    inside an enclosing torch.compile region the plain function is traced instead."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if not on_cuda or torch.compiler.is_compiling():
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flex_attend(block_mask) -> Attend:
    def attend(q, k, v):
        kernel = _flex_kernel(q.is_cuda)
        return kernel(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


# -- chunked SDPA: skip the context no anchor of a chunk can see ------------------------------
def chunk_plan(
    num_anchors: int, seq_len: int, block_size: int, chunk_anchors: int
) -> list[tuple[int, int, int]]:
    """Static (first anchor slot, end slot, context keys) per chunk of anchor slots.

    With valid anchors right-aligned in their slots (see `right_align`), sorted,
    spaced >= B and <= S - B, the anchor in slot i is at most S - (A - i) * B:
    the A - 1 - i anchors after it each need B more positions. So rows of slots
    [lo, hi) never see context at or past S - (A - hi + 1) * B. Shapes depend
    only on the config, never on the data: CUDA graphs stay valid.
    """
    plan = []
    for lo in range(0, num_anchors, chunk_anchors):
        hi = min(lo + chunk_anchors, num_anchors)
        keys = seq_len - (num_anchors - hi + 1) * block_size
        keys = min(seq_len, max(0, -(-keys // 8) * 8))  # rounded up to 8: aligned mask rows
        plan.append((lo, hi, keys))
    return plan


def right_align(anchor_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot permutations that move each row's valid anchors (a prefix, as the sampler
    lays them out) to the end: (to_aligned, from_aligned), both [N, A] indices for gather."""
    n, num_anchors = anchor_valid.shape
    count = anchor_valid.sum(1, keepdim=True)  # [N, 1]
    slots = torch.arange(num_anchors, device=anchor_valid.device).expand(n, -1)
    return (slots + count) % num_anchors, (slots - count) % num_anchors


def chunked_sdpa_attend(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    seq_len: int,
    block_size: int,
    chunk_anchors: int,
    doc_ids: torch.Tensor | None = None,
) -> Attend:
    """SDPA per chunk of anchors; `anchors`/`anchor_valid` must already be right-aligned.

    Exactly the dense rule (same visible keys per row), computed only over the
    keys a chunk can reach; masks are built once per step, shared by all layers.
    """
    n, num_anchors = anchors.shape
    plan = chunk_plan(num_anchors, seq_len, block_size, chunk_anchors)
    if not torch.compiler.is_compiling():
        # The plan is only exact under the sampler's layout; check it where a check
        # costs nothing (eager), as a device-side assert (no host sync).
        bound = (
            seq_len - (num_anchors - torch.arange(num_anchors, device=anchors.device)) * block_size
        )
        torch._assert_async(
            ((anchors <= bound) | ~anchor_valid).all(),
            "sdpa_chunked needs sorted anchors spaced >= block_size, valid ones right-aligned",
        )
    masks = []
    for lo, hi, keys in plan:
        sub = slice(lo, hi)
        masks.append(
            dense_block_mask(anchors[:, sub], anchor_valid[:, sub], keys, block_size, doc_ids)
        )

    def attend(q, k, v):
        groups = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        outs = []
        for (lo, hi, keys), mask in zip(plan, masks, strict=True):
            rows = slice(lo * block_size, hi * block_size)
            own = slice(seq_len + lo * block_size, seq_len + hi * block_size)
            kc = torch.cat([k[:, :, :keys], k[:, :, own]], dim=2)
            vc = torch.cat([v[:, :, :keys], v[:, :, own]], dim=2)
            outs.append(F.scaled_dot_product_attention(q[:, :, rows], kc, vc, attn_mask=mask))
        return torch.cat(outs, dim=2)

    return attend
