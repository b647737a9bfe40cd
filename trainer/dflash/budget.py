"""One recipe, any target: size the run to a time budget and fit shapes to the data.

`train.budget_minutes` turns a wall-clock budget into a step count: a short probe times
real training steps (target forward, drafter forward and backward, on the run's own
batches and devices), then the run takes as many steps as fit the budget, less a share
kept for what the steps do not include (logging walks, mid-run and final evals, the
checkpoint). The LR schedule is sized to that count, so a budgeted run ends its cosine
where its time ends instead of stopping mid-schedule or leaving the budget unused.

`data.fit` shapes a recipe to the data it sees: data.seq_len becomes the longest
sample's length (rounded up to a block; data.seq_len is then the ceiling), and
data.num_anchors the anchors that fit most samples (one per block of loss tokens). A
value that cannot fit is a warning and the fitted value, never a failure.
"""

from __future__ import annotations

import math
import time

# Kept out of the step budget: the step probe does not time the tau~ walk on log lines,
# the mid-run evals or the final checkpoint and eval.
BUDGET_RESERVE = 0.15
# Past this many passes over the samples a drafter learns the answers by heart: the
# training rows' tau~ climbs towards the block size while the eval's stays where it was
# (a zoo target with ~500 samples ran ~130 epochs: tau~ 16.0, eval tau 3.2).
MANY_EPOCHS = 20


def steps_for_budget(
    budget_s: float, step_s: float, *, spent_s: float = 0.0, reserve: float = BUDGET_RESERVE
) -> int:
    """Steps that fit `budget_s` seconds at `step_s` a step, after `spent_s` already gone
    (model loading, the probe) and a `reserve` share kept for what steps do not time."""
    if step_s <= 0:
        raise ValueError(f"step time must be positive, got {step_s}")
    left = budget_s * (1.0 - reserve) - spent_s
    return max(1, math.floor(left / step_s))


def fit_seq_len(lengths: list[int], ceiling: int, block: int) -> int:
    """The longest sample rounded up to a whole block, at most `ceiling`, at least 2 blocks."""
    longest = max(lengths, default=ceiling)
    return max(2 * block, min(ceiling, math.ceil(longest / block) * block))


def fit_anchors(loss_tokens: list[int], wanted: int, block: int, share: float = 0.9) -> int:
    """At most `wanted` anchors, no more than fit `share` of the samples (anchors sit at
    least a block apart on loss tokens, so a sample holds loss_tokens // block)."""
    if not loss_tokens:
        return wanted
    fits = sorted(max(1, n // block) for n in loss_tokens)
    return max(1, min(wanted, fits[min(len(fits) - 1, int(share * len(fits)))]))


def fit_to_data(workload, log_note, warn) -> None:
    """data.fit: the workload's seq_len and anchors fitted to its samples (file data)."""
    data, block = workload.cfg.data, workload.cfg.drafter.block_size
    samples = workload.samples
    if not samples or data.source in ("synthetic", "random"):
        return
    lengths = [len(s.input_ids) for s in samples]
    cut = sum(1 for n in lengths if n >= data.seq_len)
    seq_len = fit_seq_len(lengths, data.seq_len, block)
    anchors = fit_anchors([s.num_loss_tokens for s in samples], data.num_anchors, block)
    if cut * 2 > len(samples):
        warn(
            f"data.seq_len {data.seq_len} cuts {cut} of {len(samples)} samples short: raise "
            "data.seq_len to train on whole answers"
        )
    if anchors < data.num_anchors:
        warn(
            f"data.num_anchors {data.num_anchors} cannot fit this data (a block of "
            f"{block} loss tokens per anchor): using {anchors}, enough for 90% of the samples"
        )
    workload.seq_len, workload.num_anchors = seq_len, anchors
    log_note(f"data.fit: seq_len {seq_len} (ceiling {data.seq_len}), {anchors} anchors")


def measure_step_seconds(workload, target_device, drafter_device, steps: int = 4) -> float:
    """Seconds one training step takes on these devices: target forward plus drafter
    forward and backward on the run's first batches, after one untimed step (warm-up);
    the probe's drafter is thrown away."""
    import torch

    target = workload.target_for(target_device)
    drafter = workload.build_drafter(drafter_device)
    loss_fn = workload.loss_module(drafter)
    params = [p for p in drafter.parameters() if p.requires_grad]

    def one(step: int) -> None:
        batch = workload.batch_for(step, 0, 1).to(target_device)
        with torch.no_grad():
            context = workload.target_context(target, batch).to(drafter_device)
        batch = batch.to(drafter_device)
        loss, _ = loss_fn(
            context, batch.input_ids, batch.anchors, batch.anchor_valid, batch.loss_mask
        )
        loss.backward()
        for p in params:
            p.grad = None

    def sync() -> None:
        for device in {torch.device(target_device), torch.device(drafter_device)}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    one(0)
    sync()
    started = time.perf_counter()
    for step in range(1, steps + 1):
        one(step)
    sync()
    return (time.perf_counter() - started) / steps


def size_to_budget(cfg, workload, num_replicas: int, world_size: int, log) -> None:
    """train.budget_minutes -> cfg.train.steps (the probe's step time and the count)."""
    import torch

    started = time.perf_counter()
    runtime = cfg.runtime
    step_s = measure_step_seconds(
        workload, torch.device(runtime.target_devices[0]), torch.device(runtime.drafter_devices[0])
    )
    budget_s = cfg.train.budget_minutes * 60
    spent = time.perf_counter() - getattr(workload, "created", started)
    cfg.train.steps = steps_for_budget(budget_s, step_s, spent_s=spent)
    samples = workload.num_samples()
    per_step = cfg.data.batch_size * num_replicas * world_size
    epochs = cfg.train.steps * per_step / max(1, samples)
    log(
        f"train.budget_minutes {cfg.train.budget_minutes:g}: {cfg.train.steps} steps at "
        f"{step_s * 1000:.0f} ms a step (probe), {spent:.0f} s spent before training, "
        f"{BUDGET_RESERVE:.0%} kept for evals and the checkpoint; "
        f"{epochs:.1f} epochs of {samples} samples"
    )
    warning = many_epochs_warning(epochs, samples)
    if warning:
        log("warning: " + warning)


def many_epochs_warning(epochs: float, samples: int) -> str | None:
    """What to say when the budget holds far more passes over the data than help."""
    if epochs <= MANY_EPOCHS:
        return None
    return (
        f"the budget holds {epochs:.0f} epochs of only {samples} samples: the drafter will "
        "learn them by heart (training tau~ rises, eval tau does not); regenerate answers "
        "for more prompts, or lower train.budget_minutes to save the GPU time"
    )
