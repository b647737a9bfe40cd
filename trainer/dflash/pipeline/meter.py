"""StepMeter: the numbers behind each step line, kept by the one thread that logs.

drafter-0 adds every finished step; every ``train.log_every`` steps (and at the last
step) the meter prints the step line with the means over the steps since the previous
line (one step's loss is too noisy to read), the throughput of that window, and the time
left at the recent step rate, and appends the same numbers to metrics.jsonl. After the
drafters are joined the main thread reads ``final_loss`` and records the evaluation.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dflash.pipeline.logging import RunLog, format_step_line
from dflash.pipeline.metrics_file import MetricsWriter

# The exact serving walk (and a mid-run eval) may take at most this share of the
# training time so far, so every measurement together stays within a few percent.
WALK_BUDGET = 0.01

# The ETA uses the step rate of the last few windows: recent enough to follow a slowdown,
# long enough not to jump with one slow window (a checkpoint, a profiler trace).
RATE_WINDOWS = 5


@dataclass
class _Window:
    steps: int = 0
    loss: float = 0.0
    acc: float = 0.0
    tau: float = 0.0
    # tau~ from the anchors as serving walks them (Workload.serving_estimate): drafted
    # tokens and blocks, summed over the steps that gave them
    serving_tokens: float = 0.0
    serving_blocks: float = 0.0
    tokens: int = 0
    acc_per_slot: list[float] = field(default_factory=list)
    grad_norm: float = 0.0  # sum over the steps that reported one
    grad_norm_max: float = 0.0
    grad_norm_steps: int = 0

    def add(self, loss: float, acc: float, tau: float, tokens: int, per_slot: list[float]) -> None:
        self.steps += 1
        self.tokens += tokens
        self.loss += loss
        self.acc += acc
        self.tau += tau
        if not self.acc_per_slot:
            self.acc_per_slot = [0.0] * len(per_slot)
        if len(per_slot) == len(self.acc_per_slot):
            self.acc_per_slot = [a + b for a, b in zip(self.acc_per_slot, per_slot, strict=True)]


class MeasurementBudget:
    """Time a measurement takes from the training thread (the exact serving walk), kept
    within `fraction` of the time trained so far: one is due when what was spent, plus
    the last one's cost again, fits that share. The first is due at once."""

    def __init__(self, fraction: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.fraction = fraction
        self.clock = clock
        self.spent = 0.0
        self.last = 0.0
        self.count = 0
        self._start: float | None = None

    def start(self) -> None:
        self._start = self.clock()

    def due(self) -> bool:
        if self.fraction <= 0 or self._start is None:
            return False
        return self.spent + self.last <= self.fraction * (self.clock() - self._start)

    def record(self, seconds: float) -> None:
        self.spent += seconds
        self.last = seconds
        self.count += 1

    def share(self) -> float:
        """What the measurements took, as a share of the time since training began."""
        if self._start is None:
            return 0.0
        return self.spent / max(1e-9, self.clock() - self._start)


class StepMeter:
    def __init__(
        self,
        log: RunLog,
        *,
        total_steps: int,
        log_every: int,
        flops_per_step: float = 0.0,
        target_flops_per_step: float = 0.0,
        peak_flops: float | None = None,
        writer: MetricsWriter | None = None,
        clock: Callable[[], float] = time.perf_counter,
        walk_budget: float = WALK_BUDGET,
        walk_set: str = "",
        walk_cover: int = 1,
    ) -> None:
        self.log = log
        self.walks = MeasurementBudget(walk_budget, clock)
        self.walk_set = walk_set  # what the walk runs on where not the batch ("": the batch)
        self.walk_cover = walk_cover  # walks that take each row of that set once
        self.clock = clock
        self.total_steps = total_steps
        self.log_every = log_every
        self.flops_per_step = flops_per_step
        self.target_flops_per_step = target_flops_per_step
        self.peak_flops = peak_flops
        self._queue_depth = 0  # at the last step line
        self.writer = writer
        self.final_loss: float | None = None  # mean loss of the last logged window
        self.last_step = 0
        self._window = _Window()
        self._window_steps_timed = 0  # steps of the window before the last restart_window()
        self._window_start = self.clock()
        self._training_start = self._window_start
        self._rates: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOWS)  # (steps, seconds)

    def start(self) -> None:
        """Training begins now: warm-up is no training time."""
        self._window_start = self._training_start = self.clock()
        self.walks.start()

    def restart_window(self) -> None:
        """Drop the steps counted so far from the throughput (e.g. a profiler trace just
        took time that is no training); their loss still counts."""
        self._window_start = self.clock()
        self._window_steps_timed = self._window.steps

    def add(
        self,
        step: int,
        *,
        loss: float,
        tokens: int,
        metrics: dict,
        tau: float,
        lr: float,
        queue_depth: int,
        queue_size: int,
        grad_norm: float | None = None,
        serving_tau: float | None = None,
        serving_estimate: tuple[float, float] | None = None,
    ) -> int:
        """A finished step with a finite loss (``tokens``: over all replicas); prints the
        step line when one is due and returns how many steps that line covers (else 0).

        ``tau``: the step's mean acceptance over its sampled anchors;
        ``serving_estimate``: (tokens, blocks) of its anchors as serving would walk them
        (the step line's tau~ is tokens / blocks over the window; without it, the
        anchors' mean); ``serving_tau`` (when measured): the exact serving walk over
        rows of the batch, recorded as ``tau_walk``."""
        acc = metrics.get("acc", 0.0)
        per_slot = metrics.get("per_slot_acc") or []
        per_slot = [float(a) for a in per_slot] if isinstance(per_slot, list) else [per_slot]
        if isinstance(acc, list):
            acc = sum(acc) / max(1, len(acc))
        self._window.add(loss, float(acc), tau, tokens, per_slot)
        if serving_estimate is not None:
            self._window.serving_tokens += serving_estimate[0]
            self._window.serving_blocks += serving_estimate[1]
        if grad_norm is not None:
            window = self._window
            window.grad_norm += grad_norm
            # max() would keep a NaN only when it comes first: a NaN norm always shows.
            if grad_norm != grad_norm or not grad_norm <= window.grad_norm_max:
                window.grad_norm_max = grad_norm
            window.grad_norm_steps += 1
        self.last_step = step
        if not self.due(step):
            return 0
        steps = self._window.steps
        self._emit(step, lr, queue_depth, queue_size, serving_tau)
        return steps

    def due(self, step: int) -> bool:
        """Does step `step` print a step line?"""
        return step % self.log_every == 0 or step == self.total_steps

    def walk_due(self, step: int, at_the_end: bool = False) -> bool:
        """Does step `step` walk? A logged step, while the walk budget allows; with
        `at_the_end`, the last step too, whatever the budget."""
        last = at_the_end and step == self.total_steps
        return self.due(step) and (self.walks.due() or last)

    def _emit(
        self, step: int, lr: float, queue_depth: int, queue_size: int, serving_tau=None
    ) -> None:
        now = self.clock()
        window, n = self._window, self._window.steps
        timed_steps = n - self._window_steps_timed
        seconds = max(1e-9, now - self._window_start)
        steps_per_s = timed_steps / seconds
        self._rates.append((timed_steps, seconds))
        recent_steps = sum(s for s, _ in self._rates)
        recent_seconds = sum(t for _, t in self._rates)
        eta_s = (self.total_steps - step) * recent_seconds / max(1, recent_steps)
        mfu = None
        if self.peak_flops:
            flops = self.flops_per_step * timed_steps
            if step == self.total_steps and queue_depth < self._queue_depth:
                # The last window drains the queue: those batches' target forwards ran in
                # earlier windows (and were counted there), so they are not counted again.
                drained = min(timed_steps, self._queue_depth - queue_depth)
                flops -= self.target_flops_per_step * drained
            mfu = flops / seconds / self.peak_flops
        self._queue_depth = queue_depth
        record = {
            "kind": "step",
            "step": step,
            "total_steps": self.total_steps,
            "time": round(time.time(), 3),
            "loss": window.loss / n,
            "acc": window.acc / n,
            "acc_per_slot": [round(a / n, 4) for a in window.acc_per_slot],
            # tau~: the window's anchors as serving walks them (trainer/README.md),
            # else their mean; tau_anchors: the anchors' mean; tau_walk: the exact walk
            # over rows of this step's batch, when it ran (within its time budget).
            "tau": (
                window.serving_tokens / window.serving_blocks
                if window.serving_blocks > 0
                else window.tau / n
            ),
            "tau_anchors": window.tau / n,
            "tau_walk": serving_tau,
            "tau_walk_heldout": bool(self.walk_set) if serving_tau is not None else None,
            "tau_walk_set": (self.walk_set or "batch") if serving_tau is not None else None,
            "tau_walk_cover": self.walk_cover if serving_tau is not None else None,
            "lr": lr,
            # total norm of the gradients before clipping (mean of the window, and its max)
            "grad_norm": window.grad_norm / window.grad_norm_steps
            if window.grad_norm_steps
            else None,
            "grad_norm_max": window.grad_norm_max if window.grad_norm_steps else None,
            "tokens_per_s": round(window.tokens / n * steps_per_s, 1),
            "steps_per_s": round(steps_per_s, 4),
            "mfu": mfu,
            "queue_depth": queue_depth,
            "queue_size": queue_size,
            "elapsed_s": round(now - self._training_start, 3),
            "eta_s": round(eta_s, 1),
        }
        self.final_loss = record["loss"]
        self.log.line(
            format_step_line(
                step=step,
                total=self.total_steps,
                loss=record["loss"],
                acc=record["acc"],
                tau=record["tau"],
                lr=lr,
                grad_norm=record["grad_norm"],
                tokens_per_s=record["tokens_per_s"],
                mfu=mfu,
                queue_depth=queue_depth,
                queue_size=queue_size,
                eta_s=eta_s,
            )
        )
        if serving_tau is not None:
            self.log.line(
                f"tau walk | step {step} | tau {serving_tau:.2f} (tau~ {record['tau']:.2f}) | "
                f"{self.walks.last:.2f} s | {self.walks.count} walks, "
                f"{100 * self.walks.share():.1f}% of the training time"
                + (f" | {self.walk_set}" if self.walk_set else "")
            )
        if self.writer is not None:
            self.writer.write(record)
        self._window, self._window_steps_timed = _Window(), 0
        self._window_start = now

    def record_start(self, config: dict, start_step: int) -> None:
        """The resolved config, once per start (a resume starts again at its checkpoint's
        step): what `dflashctl runs show` summarises."""
        if self.writer is not None:
            self.writer.write(
                {
                    "kind": "start",
                    "step": start_step,
                    "time": round(time.time(), 3),
                    "config": config,
                }
            )

    def record_eval(self, fields: dict, step: int | None = None) -> None:
        """An evaluation: every eval.every steps (drafter-0, between steps) and at the end
        (main thread, after the drafters were joined)."""
        if self.writer is not None:
            at = self.last_step if step is None else step
            self.writer.write({"kind": "eval", "step": at, "time": round(time.time(), 3), **fields})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class TargetTimer:
    """Target forward time per batch: CUDA events on the loop's stream, read once the GPU
    passed them (never a synchronize: a drafter may be capturing); the wall clock on CPU."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self._open: deque = deque()
        self._lock = threading.Lock()
        self.total_ms = 0.0
        self.count = 0
        self._started = 0.0

    def start(self) -> None:
        if self.stream is None:
            self._started = time.perf_counter()
            return
        begin = torch.cuda.Event(enable_timing=True)
        begin.record(self.stream)
        self._open.append([begin, None])

    def stop(self) -> None:
        if self.stream is None:
            with self._lock:
                self.total_ms += 1000 * (time.perf_counter() - self._started)
                self.count += 1
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        self._open[-1][1] = end
        self._collect()

    def _collect(self) -> None:
        while self._open and self._open[0][1] is not None and self._open[0][1].query():
            begin, end = self._open.popleft()
            with self._lock:
                self.total_ms += begin.elapsed_time(end)
                self.count += 1

    def take_mean_ms(self) -> float | None:
        with self._lock:
            mean = self.total_ms / self.count if self.count else None
            self.total_ms, self.count = 0.0, 0
        return mean
