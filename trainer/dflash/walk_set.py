"""The rows the tau walk walks where they are not the training batch.

Past the first epoch a walk on the batch about to be trained on measures memorisation
(a drafter that has seen a row a few times accepts nearly all of it). Two sets walk
text the drafter never trained on:

- ``train.tau_walk_heldout: N``: N data-file samples kept from training (held-out tau:
  the training prompts' distribution).
- ``train.tau_walk_eval: true``: the eval prompts, answered once by the target itself
  before training (greedy, ``eval.max_new_tokens``, the eval's stop token): the walk's
  text is then the text the eval decodes, so its tau is what the eval will measure,
  taken as training goes for a walk's cost instead of a decode's.

Either way the walks take the set's rows in turn, so successive walks cover all of it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from .data import Sample, collate, split_by_prompt
from .spec_decode import GreedyReferences, length_groups
from .target import target_context

HELDOUT = "held-out samples"
EVAL_PROMPTS = "eval prompts"


class WalkSet:
    """Samples walked in turn; an eval set is answered by `prepare` (before the threads)."""

    def __init__(
        self,
        label: str,
        samples: list[Sample] | None = None,
        *,
        answer: Callable[[], list[Sample]] | None = None,
        size: int | None = None,
    ) -> None:
        self.label = label
        self.samples = list(samples or [])
        self._answer = answer  # makes the samples (the eval prompts answered)
        self.size = len(self.samples) if size is None else size
        self._next = 0

    def prepare(self) -> str | None:
        """Answer the eval prompts (once); a line for the run's log, None if nothing ran."""
        if self._answer is None:
            return None
        started = time.perf_counter()
        self.samples, self._answer = self._answer(), None
        tokens = sum(s.num_loss_tokens for s in self.samples)
        return (
            f"tau walk: {len(self.samples)} eval prompts answered by the target "
            f"({tokens} tokens, {time.perf_counter() - started:.1f} s): "
            "the walk's tau is the eval's, measured as training goes"
        )

    def take(self, rows: int) -> list[Sample]:
        """The next `rows` samples (all of them where `rows` is as many or more)."""
        if self._answer is not None:
            self.prepare()
        n = len(self.samples)
        picked = [self.samples[(self._next + i) % n] for i in range(min(rows, n))]
        self._next = (self._next + len(picked)) % max(n, 1)
        return picked

    def walks_to_cover(self, rows: int) -> int:
        """How many walks of `rows` rows take every sample once (the bench's last cycle)."""
        return max(1, math.ceil(self.size / max(rows, 1)))


def split_heldout(
    samples: list[Sample], count: int, seed: int
) -> tuple[list[Sample], list[Sample]]:
    """(training samples, about `count` held out): whole prompts with all their answers
    (the walk walks them all) until `count` samples, the same in every process."""
    keep, held = split_by_prompt(samples, count, seed * 7_919 + 29, count_samples=True)
    return keep, [sample for group in held for sample in group]


@torch.no_grad()
def answered_prompts(
    target: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: list[int] | None,
    batch_size: int,
    references: GreedyReferences,
) -> list[Sample]:
    """Each prompt with the target's own greedy answer as the loss region: the reference
    the eval's speculative decoding must reproduce, token for token, made in the eval's
    batches and kept in `references`, so the eval does not decode it again."""
    device = next(target.parameters()).device
    found: dict[int, Sample] = {}
    for group in length_groups([len(p) for p in prompts], batch_size):
        part = [torch.tensor(prompts[i], device=device) for i in group]
        # decoded as the eval decodes them (eval.batch_size 1: one prompt at a time)
        answers = references.of(
            target, part, max_new_tokens, stop_token_ids, batched=batch_size > 1
        )
        for i, (answer, _) in zip(group, answers, strict=True):
            mask = [False] * len(prompts[i]) + [True] * len(answer)
            found[i] = Sample(list(prompts[i]) + answer, mask)
    return [found[i] for i in range(len(prompts))]


@torch.no_grad()
def walk_inputs(
    picked: list[Sample],
    target: nn.Module,
    layer_ids: list[int],
    pad_id: int,
    like: torch.Tensor,
):
    """(context, input_ids, loss_mask) of `picked`, each as long as the longest of them,
    the context made with transformers' eager forward one row at a time (the target
    thread's compiled forward is not called from another thread)."""
    collated = collate(picked, max(len(s.input_ids) for s in picked), len(picked), pad_id)
    device = next(target.parameters()).device
    rows = []
    for ids, kept in zip(collated.input_ids, collated.attention_mask, strict=True):
        length = int(kept.sum())  # no pad in the row's forward; zeros past it (no loss there)
        part = target_context(target, ids[None, :length].to(device), None, layer_ids)
        row = part.new_zeros(1, ids.shape[0], part.shape[-1])
        row[:, :length] = part
        rows.append(row)
    context = torch.cat(rows).to(like.device, like.dtype)
    return context, collated.input_ids.to(like.device), collated.loss_mask.to(like.device)
