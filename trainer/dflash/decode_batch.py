"""Greedy and speculative decoding of several prompts at once, for a fast eval.

The one-prompt path (spec_decode.speculative_generate, target.greedy_generate) spends one
small forward per step on one prompt; eval.every during training wants many prompts at
that cost. Here N prompts share each forward: they are left-padded to one length and the
rows advance in lockstep. Rows accept different numbers of drafted tokens, so no cache is
cropped: every verify step appends the whole block to the target's and the drafter's
caches and a per-row slot mask hides what a row rejected (and its padding) from every
later query. Positions are per row (RoPE sees each row's own token positions), so each
row computes what the one-prompt path computes; only the shapes differ (padding, masked
slots), which in float32 changes no chosen token and in bf16 moves the same near-ties
the one-prompt path meets. The bookkeeping per row (tokens, acceptance lengths, the
verifier's argmax and top-2 margins, stop tokens, max_new_tokens) is the one-prompt
path's, so `evaluate` reports the same numbers either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .decode_attention import decoding
from .masks import sdpa_attend
from .model import DFlashDrafter, LayerKV
from .target import masked_forward, new_cache, select_layers


@dataclass
class SpecOutput:
    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens produced per verify step
    target_forwards: int = 0
    # Per emitted token: the target's argmax and top-2 logit margin in the forward that verified it.
    verify_argmax: list[int] = field(default_factory=list)
    verify_margin: list[float] = field(default_factory=list)

    @property
    def verification_exact(self) -> bool:
        """Every emitted token is the target's argmax in its verifying forward."""
        return self.tokens == self.verify_argmax[: len(self.tokens)]


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit along the last dimension (0: a tie)."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def accepted_prefix(proposal: torch.Tensor, verified: torch.Tensor) -> int:
    """Greedy verification: how many leading drafted tokens equal the target's own choice."""
    return int((proposal == verified[: proposal.shape[0]]).long().cumprod(0).sum())


def left_pad(prompts: list[torch.Tensor], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """(ids [N, P], slot mask [N, P] bool, positions [N, P]) of 1-D prompts, left-padded."""
    if any(p.numel() == 0 for p in prompts):
        raise ValueError("every eval prompt needs at least one token")
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel() :] = prompt.to(device)
        mask[row, width - prompt.numel() :] = True
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    return ids, mask, positions


class BatchedDrafterCache:
    """The drafter's fused-context keys/values for N rows, with a slot mask per row."""

    def __init__(self) -> None:
        self.layers: list[LayerKV] | None = None
        self.mask: torch.Tensor | None = None  # [N, slots] bool: slot holds a verified position

    def extend(
        self, drafter: DFlashDrafter, context: torch.Tensor, positions: torch.Tensor, valid
    ) -> None:
        """Append target hidden states [N, c, k*H] at positions [N, c]; valid [N, c] bool."""
        new = drafter.context_kv(drafter.fuse(context), positions)
        if self.layers is None:
            self.layers, self.mask = new, valid
            return
        self.layers = [
            (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
            for (k, v), (nk, nv) in zip(self.layers, new, strict=True)
        ]
        self.mask = torch.cat([self.mask, valid], dim=1)


@torch.no_grad()
def draft_blocks(
    drafter: DFlashDrafter, cache: BatchedDrafterCache, first: torch.Tensor, start: torch.Tensor
) -> torch.Tensor:
    """Proposals [N, B-1]: each row's block [first, MASK...] at positions start.. of that row."""
    cfg = drafter.cfg
    n, block = first.shape[0], cfg.block_size
    ids = torch.full((n, block), cfg.mask_token_id, dtype=torch.long, device=first.device)
    ids[:, 0] = first
    positions = start[:, None] + torch.arange(block, device=first.device)[None]
    # A block row sees its row's verified context slots and its whole block (bidirectional).
    sees = torch.cat([cache.mask, cache.mask.new_ones(n, block)], dim=1)
    attend = sdpa_attend(sees[:, None, None, :].expand(n, 1, block, sees.shape[1]))
    hidden = drafter(drafter.embed_blocks(ids), positions, cache.layers, attend)
    return drafter.logits(hidden).float()[:, 1:].argmax(-1)


def _active(out: SpecOutput, max_new_tokens: int, stops: set[int]) -> bool:
    return len(out.tokens) < max_new_tokens and out.tokens[-1] not in stops


@decoding
@torch.no_grad()
def speculative_generate_batch(
    drafter: DFlashDrafter,
    target: nn.Module,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
    pad_id: int = 0,
) -> list[SpecOutput]:
    """Greedy speculative decoding of N 1-D prompts together; one SpecOutput per prompt."""
    cfg = drafter.cfg
    stops = set(stop_token_ids or [])
    device = next(target.parameters()).device
    ids, slots, positions = left_pad(prompts, pad_id, device)
    target_cache, draft_cache = new_cache(target), BatchedDrafterCache()
    out = masked_forward(target, ids, positions, slots.long(), target_cache, hidden=True)
    context = select_layers(out.hidden_states, cfg.target_layer_ids)
    draft_cache.extend(drafter, context, positions, slots)
    first = out.logits[:, -1].argmax(-1)
    margins = top2_margin(out.logits[:, -1])
    results = [
        SpecOutput(
            tokens=[int(t)], target_forwards=1, verify_argmax=[int(t)], verify_margin=[float(m)]
        )
        for t, m in zip(first.tolist(), margins.tolist(), strict=True)
    ]
    token = first  # per row: the last verified token, not yet run through the target
    start = slots.sum(1)  # per row: that token's position
    offsets = torch.arange(cfg.block_size, device=device)[None]
    while True:
        active = [_active(r, max_new_tokens, stops) for r in results]
        if not any(active):
            return results
        proposal = draft_blocks(drafter, draft_cache, token, start)
        block = torch.cat([token[:, None], proposal], dim=1)
        block_positions = start[:, None] + offsets
        slots = torch.cat([slots, slots.new_ones(block.shape)], dim=1)
        out = masked_forward(
            target, block, block_positions, slots.long(), target_cache, hidden=True
        )
        verified = out.logits.argmax(-1)  # [N, B]: the target's choice after each position
        block_margins = top2_margin(out.logits)
        # Every row's accepted prefix at once, on the device; then one copy to the host
        # per step (a copy per row was a device sync per row and step: most of an eval's
        # time at small shapes).
        accepted = (proposal == verified[:, :-1]).long().cumprod(1).sum(1)
        token = verified.gather(1, accepted[:, None])[:, 0]
        host = torch.cat([proposal, verified, accepted[:, None]], dim=1).tolist()
        host_margins = block_margins.tolist()
        width = proposal.shape[1]
        for row, result in enumerate(results):
            if not active[row]:
                continue
            drafted, target_says = host[row][:width], host[row][width:-1]
            taken = host[row][-1]
            new_tokens = drafted[:taken] + [target_says[taken]]
            for i, t in enumerate(new_tokens):
                if t in stops:
                    new_tokens = new_tokens[: i + 1]
                    break
            new_tokens = new_tokens[: max_new_tokens - len(result.tokens)]
            result.target_forwards += 1
            result.verify_argmax.extend(target_says[: len(new_tokens)])
            result.verify_margin.extend(host_margins[row][: len(new_tokens)])
            result.tokens.extend(new_tokens)
            result.acceptance_lengths.append(len(new_tokens))
        # Slots start..start+accepted of a row hold verified tokens; the rest stay hidden.
        kept = offsets <= accepted[:, None]
        slots[:, -cfg.block_size :] = kept
        context = select_layers(out.hidden_states, cfg.target_layer_ids)
        draft_cache.extend(drafter, context, block_positions, kept)
        start = start + accepted + 1


@decoding
@torch.no_grad()
def greedy_generate_batch_padded(
    target: nn.Module,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
    pad_id: int = 0,
) -> list[tuple[list[int], list[float]]]:
    """The target's own greedy continuations of N 1-D prompts, with each chosen token's
    top-2 margin: per prompt what target.greedy_generate(..., margins=) gives."""
    stops = set(stop_token_ids or [])
    device = next(target.parameters()).device
    ids, slots, positions = left_pad(prompts, pad_id, device)
    cache = new_cache(target)
    out = masked_forward(target, ids, positions, slots.long(), cache, hidden=False)
    token = out.logits[:, -1].argmax(-1)
    margin = top2_margin(out.logits[:, -1])
    results = [([int(t)], [float(m)]) for t, m in zip(token.tolist(), margin.tolist(), strict=True)]
    start = slots.sum(1)
    while True:
        active = [len(g) < max_new_tokens and g[-1] not in stops for g, _ in results]
        if not any(active):
            return results
        slots = torch.cat([slots, slots.new_ones(len(prompts), 1)], dim=1)
        out = masked_forward(
            target, token[:, None], start[:, None], slots.long(), cache, hidden=False
        )
        token = out.logits[:, -1].argmax(-1)
        tokens, margin = token.tolist(), top2_margin(out.logits[:, -1]).tolist()  # one copy each
        for row, (generated, margins) in enumerate(results):
            if active[row]:
                generated.append(tokens[row])
                margins.append(margin[row])
        start = start + 1
