"""Greedy speculative decoding with a DFlash drafter, and the evaluation built on it.

Each step the block is [last verified token, MASK x (B-1)] at positions start..;
one drafter forward proposes B-1 tokens; the target verifies the whole block in
one cached forward; the matching prefix plus the target's bonus token are kept.
Only the accepted positions' hidden states (start .. start+accepted) extend the
drafter's context: the bonus token has no target hidden state yet, exactly as
the anchor in training sees context strictly before it. Both sides keep a KV
cache; the target's is cropped back past rejected positions.

With greedy verification the output equals the target's own greedy output;
`evaluate` checks that token for token, there and then.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .masks import sdpa_attend
from .model import DFlashDrafter, LayerKV
from .target import cached_forward, crop_cache, greedy_generate, new_cache, select_layers


class DrafterCache:
    """Per-layer keys/values of the drafter's fused context, positions 0..length-1."""

    def __init__(self) -> None:
        self.layers: list[LayerKV] | None = None
        self.length = 0

    def extend(self, drafter: DFlashDrafter, context: torch.Tensor) -> None:
        """Append target hidden states [1, c, k*H] for positions length..length+c-1."""
        positions = torch.arange(
            self.length, self.length + context.shape[1], device=context.device
        )[None]
        new = drafter.context_kv(drafter.fuse(context), positions)
        if self.layers is None:
            self.layers = new
        else:
            self.layers = [
                (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                for (k, v), (nk, nv) in zip(self.layers, new, strict=True)
            ]
        self.length += context.shape[1]


@torch.no_grad()
def draft_block_logits(
    drafter: DFlashDrafter, cache: DrafterCache, first_token: int
) -> torch.Tensor:
    """Logits [1, B, V] of a block [first_token, MASK...] placed right after the cached context."""
    if cache.layers is None:
        raise ValueError(
            "the drafter cache is empty: extend it with the prompt's hidden states first"
        )
    cfg = drafter.cfg
    device = cache.layers[0][0].device
    ids = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=device)
    ids[0, 0] = first_token
    positions = torch.arange(cache.length, cache.length + cfg.block_size, device=device)[None]
    # Block rows see all cached context (all of it precedes the block) and each other.
    hidden = drafter(drafter.embed_blocks(ids), positions, cache.layers, sdpa_attend(None))
    return drafter.logits(hidden).float()


@dataclass
class SpecOutput:
    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens produced per verify step
    target_forwards: int = 0


@torch.no_grad()
def speculative_generate(
    drafter: DFlashDrafter,
    target: nn.Module,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
) -> SpecOutput:
    """Greedy speculative decoding of one prompt [1, P]."""
    cfg = drafter.cfg
    stops = set(stop_token_ids or [])
    target_cache, draft_cache = new_cache(target), DrafterCache()
    out = cached_forward(target, prompt_ids, 0, target_cache, hidden=True)
    draft_cache.extend(drafter, select_layers(out.hidden_states, cfg.target_layer_ids))
    token = int(out.logits[0, -1].argmax())
    result = SpecOutput(tokens=[token], target_forwards=1)
    start = prompt_ids.shape[1]  # position of `token`, which the target has not processed yet
    while len(result.tokens) < max_new_tokens and token not in stops:
        proposal = draft_block_logits(drafter, draft_cache, token)[0, 1:].argmax(-1)
        block = torch.cat([proposal.new_tensor([token]), proposal])[None]
        out = cached_forward(target, block, start, target_cache, hidden=True)
        result.target_forwards += 1
        verified = out.logits[0].argmax(-1)  # the target's choice after each block position
        accepted = int((proposal == verified[:-1]).long().cumprod(0).sum())
        new_tokens = proposal[:accepted].tolist() + [int(verified[accepted])]
        for i, t in enumerate(new_tokens):
            if t in stops:
                new_tokens = new_tokens[: i + 1]
                break
        new_tokens = new_tokens[: max_new_tokens - len(result.tokens)]
        result.tokens.extend(new_tokens)
        result.acceptance_lengths.append(len(new_tokens))
        # Positions start..start+accepted hold verified tokens; their hidden states are final.
        crop_cache(target_cache, start + accepted + 1)
        draft_cache.extend(
            drafter, select_layers(out.hidden_states, cfg.target_layer_ids)[:, : accepted + 1]
        )
        start += accepted + 1
        token = new_tokens[-1]
    return result


@dataclass
class EvalResult:
    tau: float  # mean tokens produced per verify step (accepted drafts + bonus)
    lossless: bool  # speculative output == target greedy output for every prompt
    num_tokens: int  # tokens generated over all prompts
    tokens_per_target_forward: float  # num_tokens / target forwards (prefills included)
    num_prompts: int
    mismatched_prompts: list[int] = field(default_factory=list)
    # prompt index -> first generated position where speculative and greedy output differ
    first_divergence: dict[int, int] = field(default_factory=dict)

    def format_line(self) -> str:
        return (
            f"eval | tau {self.tau:.2f} | lossless {'yes' if self.lossless else 'no'} | "
            f"{self.num_tokens} tokens | {self.tokens_per_target_forward:.1f} tokens/target forward"
        )

    def metrics(self) -> dict:
        """The numbers metrics.jsonl records for this evaluation."""
        return {
            "tau": self.tau,
            "lossless": self.lossless,
            "tokens": self.num_tokens,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "prompts": self.num_prompts,
        }


@torch.no_grad()
def evaluate(
    drafter: DFlashDrafter,
    target: nn.Module,
    prompts: list,
    *,
    max_new_tokens: int = 64,
    stop_token_ids: list[int] | None = None,
) -> EvalResult:
    """Speculative decoding over held-out prompts (token id lists or 1-D tensors), checked against greedy."""
    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    device = next(target.parameters()).device
    was_training = drafter.training
    drafter.eval()
    try:
        steps: list[int] = []
        num_tokens = forwards = 0
        divergence: dict[int, int] = {}
        for index, prompt in enumerate(prompts):
            ids = torch.as_tensor(prompt, dtype=torch.long, device=device).reshape(1, -1)
            spec = speculative_generate(drafter, target, ids, max_new_tokens, stop_token_ids)
            reference, _ = greedy_generate(target, ids, max_new_tokens, stop_token_ids)
            if spec.tokens != reference:
                divergence[index] = next(
                    (
                        i
                        for i, (a, b) in enumerate(zip(spec.tokens, reference, strict=False))
                        if a != b
                    ),
                    min(len(spec.tokens), len(reference)),
                )
            steps.extend(spec.acceptance_lengths)
            num_tokens += len(spec.tokens)
            forwards += spec.target_forwards
    finally:
        drafter.train(was_training)
    return EvalResult(
        tau=sum(steps) / len(steps) if steps else 1.0,
        lossless=not divergence,
        num_tokens=num_tokens,
        tokens_per_target_forward=num_tokens / forwards,
        num_prompts=len(prompts),
        mismatched_prompts=sorted(divergence),
        first_divergence=divergence,
    )
