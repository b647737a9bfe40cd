"""Greedy speculative decoding with a DFlash drafter, and the evaluation built on it.

Each step the block is [last verified token, MASK x (B-1)] at positions start..;
one drafter forward proposes B-1 tokens; the target verifies the whole block in
one cached forward; the matching prefix plus the target's bonus token are kept.
Only the accepted positions' hidden states (start .. start+accepted) extend the
drafter's context: the bonus token has no target hidden state yet, exactly as
the anchor in training sees context strictly before it. Both sides keep a KV
cache; the target's is cropped back past rejected positions.

With greedy verification the output equals the target's own greedy output;
`evaluate` checks that token for token, there and then. Where it does not, the
report tells a real bug from a numerical near-tie: it records, for every emitted
token, the target's argmax and top-2 logit margin in the forward that verified it
(verification is exact when every emitted token is that argmax), and the margin
of the target's own one-token-at-a-time forward where the outputs part. A block
verified in one forward and the same tokens fed one at a time round differently
in bf16; when the margin there is within that noise and verification was exact,
the difference is a near-tie, not a bug (verify in float32 to make it go away).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .decode_attention import decoding
from .decode_batch import (
    SpecOutput,
    accepted_prefix,
    greedy_generate_batch_padded,
    speculative_generate_batch,
    top2_margin,
)
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


@decoding
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
    result = SpecOutput(
        tokens=[token],
        target_forwards=1,
        verify_argmax=[token],
        verify_margin=[float(top2_margin(out.logits[0, -1]))],
    )
    start = prompt_ids.shape[1]  # position of `token`, which the target has not processed yet
    while len(result.tokens) < max_new_tokens and token not in stops:
        proposal = draft_block_logits(drafter, draft_cache, token)[0, 1:].argmax(-1)
        block = torch.cat([proposal.new_tensor([token]), proposal])[None]
        out = cached_forward(target, block, start, target_cache, hidden=True)
        result.target_forwards += 1
        verified = out.logits[0].argmax(-1)  # the target's choice after each block position
        accepted = accepted_prefix(proposal, verified)
        new_tokens = proposal[:accepted].tolist() + [int(verified[accepted])]
        margins = top2_margin(out.logits[0])
        for i, t in enumerate(new_tokens):
            if t in stops:
                new_tokens = new_tokens[: i + 1]
                break
        new_tokens = new_tokens[: max_new_tokens - len(result.tokens)]
        result.verify_argmax.extend(verified[: len(new_tokens)].tolist())
        result.verify_margin.extend(margins[: len(new_tokens)].tolist())
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


# A top-2 margin at or below this (in logits) is within the rounding noise of a bf16/fp16
# forward whose shape differs (a block vs one token); float32 forwards agree far closer.
NEAR_TIE_MARGIN = {torch.bfloat16: 0.25, torch.float16: 0.05, torch.float32: 1e-3}


@dataclass
class Divergence:
    """Where the speculative output first parts from the target's own greedy output."""

    prompt: int
    position: int  # index into the generated tokens
    speculative_token: int | None  # None: the output ended there
    greedy_token: int | None
    greedy_margin: float | None  # target top-2 margin there, one token at a time
    verify_margin: float | None  # target top-2 margin there, in the verifying block forward
    verification_exact: bool  # every emitted token was the verifier's argmax
    near_tie: bool

    @property
    def verdict(self) -> str:
        if not self.verification_exact:
            return (
                "bug: a token was emitted that is not the target's argmax in its verifying forward"
            )
        if self.near_tie:
            return (
                "near-tie: verification exact, the target's top-2 logits are within rounding there"
            )
        return "bug: verification exact, but the block forward and the one-token forward disagree by more than rounding"

    def to_dict(self) -> dict:
        return {**self.__dict__, "verdict": self.verdict}


@dataclass
class EvalResult:
    tau: float  # mean tokens produced per verify step (accepted drafts + bonus)
    # No bug: the speculative output equals the target's greedy output for every prompt,
    # or differs only at near-ties under exact verification (identical says which).
    lossless: bool
    num_tokens: int  # tokens generated over all prompts
    tokens_per_target_forward: float  # num_tokens / target forwards (prefills included)
    num_prompts: int
    mismatched_prompts: list[int] = field(default_factory=list)
    # prompt index -> first generated position where speculative and greedy output differ
    first_divergence: dict[int, int] = field(default_factory=dict)
    divergences: list[Divergence] = field(default_factory=list)
    verification_exact: bool = True  # every emitted token of every prompt was the verifier's argmax
    per_prompt: list[dict] = field(default_factory=list)
    target_dtype: str = ""
    identical: bool | None = None  # speculative == greedy token for token (None: lossless)
    checkpoint: str | None = None  # what was measured (set by the caller that loaded it)
    results_path: str | None = None
    # Per drafted slot k = 1..B-1: the share of verify steps whose k-th drafted token was
    # accepted (what serving reports as per-position acceptance).
    accepted_by_position: list[float] = field(default_factory=list)

    @property
    def bugs(self) -> list[Divergence]:
        """Divergences that no rounding explains (the near-ties are not among them)."""
        return [d for d in self.divergences if not d.verdict.startswith("near-tie")]

    @property
    def near_ties(self) -> list[Divergence]:
        return [d for d in self.divergences if d.verdict.startswith("near-tie")]

    @property
    def is_identical(self) -> bool:
        return self.lossless and not self.divergences if self.identical is None else self.identical

    def lossless_text(self) -> str:
        """The headline's verdict: yes when the outputs match or every difference is a
        near-tie under exact verification (the target's own rounding), else where the bug is."""
        bugs = self.bugs
        if bugs:
            first = bugs[0]
            return f"lossless NO: bug at prompt {first.prompt}, token {first.position}"
        if not self.lossless:  # built by hand without the divergences that say where
            return "lossless NO"
        if self.divergences:
            dtype = self.target_dtype.replace("bfloat16", "bf16").replace("float16", "fp16")
            dtype = dtype.replace("float32", "fp32") or "target-dtype"
            return (
                f"lossless yes (exact; {len(self.divergences)} of {self.num_prompts} prompts "
                f"meet {dtype} near-ties)"
            )
        return "lossless yes"

    def format_line(self) -> str:
        line = (
            f"eval | tau {self.tau:.2f} | {self.lossless_text()} | "
            f"{self.num_tokens} tokens | {self.tokens_per_target_forward:.1f} tokens/target forward"
        )
        if self.divergences:
            first = (self.bugs or self.divergences)[0]
            margin = first.greedy_margin if first.greedy_margin is not None else float("nan")
            line += (
                f" | {len(self.divergences)} of {self.num_prompts} prompts differ, first "
                f"{'bug' if self.bugs else 'near-tie'}: prompt "
                f"{first.prompt} token {first.position}, top-2 margin {margin:.3g}, "
                f"verification {'exact' if first.verification_exact else 'NOT exact'}: "
                f"{first.verdict.split(':')[0]}"
            )
        if self.checkpoint:
            line += f" | checkpoint {self.checkpoint}"
        if self.results_path:
            line += f" | per prompt: {self.results_path}"
        return line

    def to_dict(self) -> dict:
        return {
            "tau": self.tau,
            "lossless": self.lossless,
            "identical": self.is_identical,
            "near_ties": len(self.near_ties),
            "verification_exact": self.verification_exact,
            "num_tokens": self.num_tokens,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "num_prompts": self.num_prompts,
            "target_dtype": self.target_dtype,
            "checkpoint": self.checkpoint,
            "accepted_by_position": self.accepted_by_position,
            "divergences": [d.to_dict() for d in self.divergences],
            "prompts": self.per_prompt,
        }

    def metrics(self) -> dict:
        """The numbers metrics.jsonl records for this evaluation."""
        return {
            "tau": self.tau,
            "lossless": self.lossless,
            "identical": self.is_identical,
            "near_ties": len(self.near_ties),
            "bugs": len(self.bugs),
            "verification_exact": self.verification_exact,
            "tokens": self.num_tokens,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "prompts": self.num_prompts,
            "accepted_by_position": self.accepted_by_position,
            "checkpoint": self.checkpoint,
        }


def _divergence(
    index: int,
    spec: SpecOutput,
    reference: list[int],
    greedy_margins: list[float],
    tie_margin: float,
) -> Divergence | None:
    if spec.tokens == reference:
        return None
    position = next(
        (i for i, (a, b) in enumerate(zip(spec.tokens, reference, strict=False)) if a != b),
        min(len(spec.tokens), len(reference)),
    )

    def at(values, i):
        return values[i] if i < len(values) else None

    greedy_margin = at(greedy_margins, position)
    verify_margin = at(spec.verify_margin, position)
    known = [m for m in (greedy_margin, verify_margin) if m is not None]
    return Divergence(
        prompt=index,
        position=position,
        speculative_token=at(spec.tokens, position),
        greedy_token=at(reference, position),
        greedy_margin=greedy_margin,
        verify_margin=verify_margin,
        verification_exact=spec.verification_exact,
        near_tie=bool(known) and min(known) <= tie_margin,
    )


@decoding
@torch.no_grad()
def evaluate(
    drafter: DFlashDrafter,
    target: nn.Module,
    prompts: list,
    *,
    max_new_tokens: int = 64,
    stop_token_ids: list[int] | None = None,
    batch_size: int = 1,
    references: GreedyReferences | None = None,
) -> EvalResult:
    """Speculative decoding over held-out prompts (token id lists or 1-D tensors), checked
    against greedy; `batch_size` prompts at a time (1: the one-prompt path). `references`
    keeps the greedy side from one eval to the next (the target is frozen)."""
    if batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be at least 1, got {batch_size}")
    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    first = next(target.parameters())
    device, dtype = first.device, first.dtype
    tie_margin = NEAR_TIE_MARGIN.get(dtype, 0.25)
    was_training = drafter.training
    drafter.eval()
    try:
        steps: list[int] = []
        num_tokens = forwards = 0
        divergences: list[Divergence] = []
        per_prompt: list[dict] = []
        tensors = [torch.as_tensor(p, dtype=torch.long, device=device).reshape(-1) for p in prompts]
        references = references or GreedyReferences()
        decoded = _decode(drafter, target, tensors, max_new_tokens, stop_token_ids, batch_size,
                          references)  # fmt: skip
        for index, (ids, (spec, reference, margins)) in enumerate(
            zip(tensors, decoded, strict=True)
        ):
            found = _divergence(index, spec, reference, margins, tie_margin)
            if found is not None:
                divergences.append(found)
            lengths = spec.acceptance_lengths
            per_prompt.append(
                {
                    "prompt": index,
                    "prompt_tokens": int(ids.numel()),
                    "tau": sum(lengths) / len(lengths) if lengths else 1.0,
                    "lossless": found is None or found.verdict.startswith("near-tie"),
                    "identical": found is None,
                    "verification_exact": spec.verification_exact,
                    "acceptance_lengths": lengths,
                    "tokens": spec.tokens,
                    "greedy_tokens": reference,
                    "divergence": found.to_dict() if found is not None else None,
                }
            )
            steps.extend(lengths)
            num_tokens += len(spec.tokens)
            forwards += spec.target_forwards
    finally:
        drafter.train(was_training)
    return EvalResult(
        tau=sum(steps) / len(steps) if steps else 1.0,
        lossless=all(d.verdict.startswith("near-tie") for d in divergences),
        identical=not divergences,
        num_tokens=num_tokens,
        tokens_per_target_forward=num_tokens / forwards,
        num_prompts=len(prompts),
        mismatched_prompts=[d.prompt for d in divergences],
        first_divergence={d.prompt: d.position for d in divergences},
        divergences=divergences,
        verification_exact=all(p["verification_exact"] for p in per_prompt),
        per_prompt=per_prompt,
        target_dtype=str(dtype).removeprefix("torch."),
        accepted_by_position=accepted_by_position(steps, drafter.cfg.block_size),
    )


def accepted_by_position(lengths: list[int], block_size: int) -> list[float]:
    """Per drafted slot 1..B-1: the share of verify steps that accepted it (a step of
    length n accepted its first n - 1 drafted tokens; the last one is the target's)."""
    if not lengths:
        return []
    return [
        round(sum(1 for n in lengths if n - 1 >= k) / len(lengths), 4) for k in range(1, block_size)
    ]


def _decode(drafter, target, prompts, max_new_tokens, stop_token_ids, batch_size, references):
    """Per prompt: (speculative output, greedy reference, the reference's top-2 margins)."""
    if batch_size == 1:
        out = []
        for ids in prompts:
            spec = speculative_generate(drafter, target, ids[None], max_new_tokens, stop_token_ids)
            ((reference, margins),) = references.of(
                target, [ids], max_new_tokens, stop_token_ids, batched=False
            )
            out.append((spec, reference, margins))
        return out
    # Prompts of like length share a batch (less padding); results go back in prompt order.
    found: dict[int, tuple] = {}
    for group in length_groups([p.numel() for p in prompts], batch_size):
        chunk = [prompts[i] for i in group]
        specs = speculative_generate_batch(drafter, target, chunk, max_new_tokens, stop_token_ids)
        greedy = references.of(target, chunk, max_new_tokens, stop_token_ids)
        for i, spec, (reference, margins) in zip(group, specs, greedy, strict=True):
            found[i] = (spec, reference, margins)
    return [found[i] for i in range(len(prompts))]


def length_groups(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices in groups of `batch_size`, prompts of like length together: the eval's
    batches, which the eval-prompt walk's answers reuse (in bf16 the padding a row shares
    its batch with can move a near-tie, so both must batch alike)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    step = max(1, batch_size)
    return [order[first : first + step] for first in range(0, len(order), step)]


class GreedyReferences:
    """The target's greedy continuations of prompt batches, with each token's top-2
    margin, computed once and kept. The target never trains, so a run's evals (mid-run
    and final) and the eval-prompt walk's answers share one greedy pass instead of one
    per eval: half of a batched eval's forwards at tau 2 (the reference runs every
    token; speculative decoding one forward per accepted block)."""

    def __init__(self) -> None:
        self._kept: dict[tuple, list[tuple[list[int], list[float]]]] = {}
        self._targets: dict[int, nn.Module] = {}  # holds each target: its id stays its own

    def of(
        self,
        target: nn.Module,
        prompts: list[torch.Tensor],
        max_new_tokens: int,
        stop_token_ids: list[int] | None,
        *,
        batched: bool = True,
    ) -> list[tuple[list[int], list[float]]]:
        """Per prompt (1-D tensors, decoded together when `batched`): (tokens, margins).
        Left padding is masked from every query, so the pad id cannot change a row."""
        key = (id(target), batched, max_new_tokens, tuple(stop_token_ids or ()),
               tuple(tuple(p.tolist()) for p in prompts))  # fmt: skip
        if key not in self._kept:
            self._targets[id(target)] = target
            if batched:
                found = greedy_generate_batch_padded(
                    target, prompts, max_new_tokens, stop_token_ids
                )
            else:
                found = []
                for ids in prompts:
                    margins: list[float] = []
                    tokens, _ = greedy_generate(
                        target, ids[None], max_new_tokens, stop_token_ids, margins=margins
                    )
                    found.append((tokens, margins))
            self._kept[key] = found
        return self._kept[key]
