"""One recipe, any target: size the run to a time budget and fit shapes to the data.

`train.budget_minutes` turns a wall-clock budget into a step count: a short probe times
real training steps (target forward, drafter forward and backward, on the run's own
batches and devices), then the run takes as many steps as fit the budget, less a share
kept for what the steps do not include (logging walks, mid-run and final evals, the
checkpoint). The LR schedule is sized to that count, so a budgeted run ends its cosine
where its time ends instead of stopping mid-schedule or leaving the budget unused.

The probe times steps alone; in training they share the devices and the interpreter with
the target loop, the prefetcher and the optimizer, and the warm-up (a compile) comes
after the probe. On a small target the probe said 34 ms a step while training took 50:
the run would end 45% past its budget. So `BudgetCheck` times real training steps early
in the run, once, and re-sizes the step count (and the LR schedule with it) so the steps
end when the budget says.

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


def size_to_budget(cfg, workload, num_replicas: int, world_size: int, log) -> tuple[float, float]:
    """train.budget_minutes -> cfg.train.steps (the probe's step time and the count).
    Returns when the steps should be done (a perf_counter time) and the probe's step time."""
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
    created = getattr(workload, "created", started)
    return created + budget_s * (1.0 - BUDGET_RESERVE), step_s


def many_epochs_warning(epochs: float, samples: int) -> str | None:
    """What to say when the budget holds far more passes over the data than help."""
    if epochs <= MANY_EPOCHS:
        return None
    return (
        f"the budget holds {epochs:.0f} epochs of only {samples} samples: the drafter will "
        "learn them by heart (training tau~ rises, eval tau does not); regenerate answers "
        "for more prompts, or lower train.budget_minutes to save the GPU time"
    )


# The re-size: timing starts this many steps into the run (the first steps pay one-off
# costs), lasts at least TIMED_STEPS and at least TIMED_SHARE of the run's steps.
SKIPPED_STEPS = 5
TIMED_STEPS = 20
TIMED_SHARE = 0.05


class BudgetCheck:
    """Re-sizes a budgeted run's step count once, from the rate of its own training steps.

    Every rank computes the same `decide_at` from the plan (start, steps, queue depth);
    the lead drafter times the steps up to it and publishes the new count; every replica
    of every rank applies it at the end of step `decide_at + 1`, before step
    `decide_at + 2` updates the weights (a replica cannot finish step decide_at + 1 before
    the lead published: they average gradients every step). The prefetcher and target
    loops run at most `2 * queue_size + 2` steps ahead of the drafters; the check is planned
    only where they cannot have reached the old end by then, so a count that grows still
    gets its batches."""

    def __init__(
        self,
        deadline: float,
        start_step: int,
        total_steps: int,
        queue_size: int,
        probe_s: float | None = None,
        clock=time.perf_counter,
    ) -> None:
        self.deadline = deadline  # clock() time by which the steps should be done
        self.probe_s = probe_s
        self.total = total_steps
        self.clock = clock
        self.first = start_step + SKIPPED_STEPS
        run = total_steps - start_step
        self.decide_at = self.first + max(TIMED_STEPS, math.ceil(TIMED_SHARE * run))
        self.active = total_steps - self.decide_at > 2 * queue_size + 8
        self.excluded = 0.0  # seconds of walks and evals: not what a step costs
        self._timing: tuple[float, float] | None = None
        self.new_total: int | None = None
        self.step_ms: float | None = None

    def exclude(self, seconds: float) -> None:
        self.excluded += seconds

    def timed(self, step_number: int, walk_s: float = 0.0) -> int | None:
        """The lead drafter, after each step (`walk_s`: the serving walks' seconds so far):
        the new step count once decided, else None."""
        if not self.active or step_number not in (self.first, self.decide_at):
            return None
        now, excluded = self.clock(), self.excluded + walk_s
        if step_number == self.first:
            self._timing = (now, excluded)
            return None
        if self._timing is None:
            # Never timed (steps come in order, so it cannot happen): keep the count, but
            # publish it all the same, so no replica or rank waits for a decision forever.
            self.new_total, self.step_ms = self.total, 0.0
            return self.total
        began, excluded_then = self._timing
        elapsed = now - began - (excluded - excluded_then)
        step_s = max(1e-6, elapsed / (step_number - self.first))
        self.step_ms = 1000 * step_s
        # A resumed run's probe count starts at step 0: the steps still planned, at the
        # probe's rate, are what is left of its budget (a fresh run: the deadline, which
        # also takes the warm-up's compile, after the probe, into account).
        left = self.deadline - now
        if self.probe_s:
            left = min(left, (self.total - step_number) * self.probe_s)
        self.new_total = step_number + max(2, math.floor(left / step_s))
        return self.new_total

    def applies_after(self, step_number: int) -> bool:
        return self.active and step_number == self.decide_at + 1

    def line(self, old_total: int) -> str:
        probe = f" (the probe timed {1000 * self.probe_s:.0f} ms alone)" if self.probe_s else ""
        return (
            f"train.budget_minutes: steps {old_total} -> {self.new_total}: training steps take "
            f"{self.step_ms:.0f} ms{probe}, so the run's steps end within its budget"
        )
