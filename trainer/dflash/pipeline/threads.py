"""The pipeline's threads: prefetcher, one target loop per target device, one drafter
per drafter device.

    prefetcher --batches--> target-i --hidden states--> drafter-j  (pipelined)
    prefetcher --batches--> drafter-j (target forward, then drafter step) (sequential)

Every queue is bounded (back-pressure); every thread but the drafters starts work only
after all drafters finished their compiled warm-up (see warmup.py). Under torchrun each
process holds one drafter and its shard of every step (``RunContext.shard_offset``);
the ranks meet after the warm-up and average through torch.distributed.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash.pipeline import stacks, tls
from dflash.pipeline.distributed import World
from dflash.pipeline.logging import RunLog, format_nonfinite_line, stage_line
from dflash.pipeline.meter import StepMeter, TargetTimer
from dflash.pipeline.optim import MasterWeightAdamW
from dflash.pipeline.replicas import flatten
from dflash.pipeline.supervisor import StopQueue, Supervisor
from dflash.pipeline.train_config import FailurePoint, TrainConfig
from dflash.pipeline.warmup import WarmupGate, warm_target
from dflash.pipeline.workload import Batch, DrafterInputs, Workload


class InjectedFailure(RuntimeError):
    """A failure planted with debug.fail_in (crash demos and tests)."""


class NonFiniteLoss(RuntimeError):
    pass


@dataclass
class DrafterReplica:
    rank: int
    device: torch.device
    model: torch.nn.Module
    loss_fn: torch.nn.Module  # compiled (or not) loss module around ``model``
    optimizer: MasterWeightAdamW
    inputs: StopQueue  # pipelined: hidden states from a target loop; sequential: batches
    target: torch.nn.Module | None = None  # sequential schedule: the target this thread runs
    target_device: torch.device | None = None
    completed_steps: int = 0
    nonfinite_count: int = 0
    graphs_recorded: int = 0

    @property
    def name(self) -> str:
        return f"drafter-{self.rank}"


@dataclass
class RunContext:
    cfg: TrainConfig
    workload: Workload
    log: RunLog
    supervisor: Supervisor
    gate: WarmupGate
    averager: Any  # replicas.GradientAverager (threads) or DistributedAverager (torchrun)
    term_requested: threading.Event
    replicas: list[DrafterReplica]
    start_step: int
    total_steps: int
    meter: StepMeter  # step lines and metrics.jsonl: written by drafter-0 only
    fail_point: FailurePoint | None = None
    hang_point: FailurePoint | None = None  # debug.hang_in
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, mean loss)
    on_checkpoint: object = None  # callable(step) used by drafter-0 for periodic saves
    # callable(): blocks until the periodic checkpoint in flight is on disk (rank 0)
    checkpoint_settled: object = None
    on_eval: object = None  # callable(step, drafter) used by drafter-0 every eval.every steps
    world: World = field(default_factory=World)  # a world of one unless torchrun made more
    warmup_started: float = 0.0  # perf_counter when the drafters began warming up
    target_timer: Any = None  # TargetTimer of target-0: forward time per batch
    budget: Any = None  # budget.BudgetCheck of a train.budget_minutes run
    _wait_s: float = 0.0  # lead drafter, this window: waiting for inputs, stepping
    _step_s: float = 0.0

    @property
    def num_drafters(self) -> int:
        return len(self.replicas)

    @property
    def shard_offset(self) -> int:
        """Global shard of this process's first drafter (torchrun: one drafter per rank)."""
        return self.world.rank * self.num_drafters

    @property
    def total_shards(self) -> int:
        return self.world.size * self.num_drafters

    @property
    def is_lead(self) -> bool:
        return self.world.is_main

    def debug_applies(self) -> bool:
        """debug.fail_in, hold_at_step and tls_fix=false act only on debug.on_ranks (all
        when empty)."""
        ranks = self.cfg.debug.on_ranks
        return not ranks or self.world.rank in ranks


def inject(ctx: RunContext, thread: str, stage: str, step: int = 0) -> None:
    hang = ctx.hang_point
    if hang is not None and (hang.thread, hang.stage) == (thread, stage) and ctx.debug_applies():
        if stage != "step" or hang.step == step:
            deadlock(ctx, thread, f"step {step}" if stage == "step" else stage)
    point = ctx.fail_point
    if point is None or (point.thread, point.stage) != (thread, stage) or not ctx.debug_applies():
        return
    if stage == "step" and point.step != step:
        return
    where = f"step {step}" if stage == "step" else stage
    marker = ctx.cfg.debug.fail_once_marker
    if marker:
        if os.path.exists(marker):
            return  # fired once already: a restarted run gets past it
        with open(marker, "w") as f:
            f.write(f"{thread} at {where}\n")
    if ctx.cfg.debug.fail_kind == "sigkill":
        # The checkpoint being written lands first: an injected kill is a demo and a
        # test of resuming from it, which a kill mid-write would make a matter of timing
        # (a real one may land mid-write: the supervisor then resumes from the one before).
        if ctx.checkpoint_settled is not None:
            try:
                ctx.checkpoint_settled()
            except Exception:  # noqa: BLE001 - the writer logged its failure
                pass
        ctx.log.line(f"injected SIGKILL in {thread} at {where} (debug.fail_in)")
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFailure(f"injected failure in {thread} at {where} (debug.fail_in)")


def deadlock(ctx: RunContext, thread: str, where: str) -> None:
    """debug.hang_in: a real deadlock (a lock taken twice), never released: the thread
    stops making progress, as a lost collective or a lock-order bug leaves it."""
    ctx.log.line(f"injected deadlock in {thread} at {where} (debug.hang_in)")
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # blocks for good


# ---------------------------------------------------------------- prefetcher


def run_prefetcher(ctx: RunContext, shard_queues: list[StopQueue], pin: bool) -> None:
    """Builds every drafter's batch for every step, in step order, to static shapes."""
    inject(ctx, "prefetcher", "start")
    ctx.gate.wait_all_warm()
    step = ctx.start_step
    while step < ctx.total_steps:  # read each step: a budget check may re-size the run
        inject(ctx, "prefetcher", "step", step + 1)
        for local in range(ctx.num_drafters):
            batch = ctx.workload.batch_for(step, ctx.shard_offset + local, ctx.total_shards)
            shard_queues[local].put(batch.pin_memory() if pin else batch)
        step += 1


# ---------------------------------------------------------------- target loops


def run_target_loop(
    ctx: RunContext,
    index: int,
    device: torch.device,
    target: torch.nn.Module,
    batches: StopQueue,
    owned: int,
) -> None:
    """No-grad target forwards; hidden states of the selected layers go to the drafter
    that owns the batch, on that drafter's device, through its bounded queue."""
    name = f"target-{index}"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    inject(ctx, name, "start")
    if ctx.workload.target_compiled(device):
        # A compile is no capture, but Dynamo is not thread-safe and its first runs may
        # synchronize: under the capture lock, counted at the gate like a drafter.
        say = lambda text: ctx.log.line(stage_line(name, str(device), text))  # noqa: E731
        warm_target(ctx.gate, say, lambda: ctx.workload.warm_target(target, device))
        ctx.gate.mark_warm()
    ctx.gate.wait_all_warm()
    # The crash detector takes a thread's stage from its last stage line.
    how = ctx.workload.target_forward_text(target, device)
    running = f"running target forwards ({how})" if how else "running target forwards"
    ctx.log.line(stage_line(name, str(device), running))
    # A side stream lets target forwards overlap the drafter steps on a shared GPU.
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    timer = TargetTimer(stream)
    if index == 0:
        ctx.target_timer = timer
    done = 0
    while done < (ctx.total_steps - ctx.start_step) * owned:  # `owned` drafters' batches a step
        done += 1
        batch: Batch = batches.get()
        inject(ctx, name, "step", batch.step + 1)
        replica = ctx.replicas[batch.shard - ctx.shard_offset]
        with torch.no_grad(), torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            timer.start()
            inputs = _target_forward(ctx, target, device, batch, replica.device)
            timer.stop()
            if stream is not None:
                inputs.ready = torch.cuda.Event()
                inputs.ready.record(stream)
        replica.inputs.put(inputs)


def _target_forward(
    ctx: RunContext,
    target: torch.nn.Module,
    target_device: torch.device,
    batch: Batch,
    drafter_device: torch.device,
) -> DrafterInputs:
    on_target = batch.to(target_device, non_blocking=True)
    context = ctx.workload.target_context(target, on_target)
    same = drafter_device == target_device
    moved = on_target if same else on_target.to(drafter_device, non_blocking=True)
    return DrafterInputs(
        step=batch.step,
        shard=batch.shard,
        context=context.to(drafter_device, non_blocking=True),
        input_ids=moved.input_ids,
        anchors=moved.anchors,
        anchor_valid=moved.anchor_valid,
        loss_mask=moved.loss_mask,
        num_tokens=batch.num_tokens,
    )


# ---------------------------------------------------------------- drafters


def run_drafter(ctx: RunContext, replica: DrafterReplica) -> None:
    name, device = replica.name, str(replica.device)
    if replica.device.type == "cuda":
        torch.cuda.set_device(replica.device)  # the current device is per thread
    inject(ctx, name, "start")
    if ctx.cfg.debug.tls_fix or not ctx.debug_applies():
        # Before any compiled call and any backward: this thread's own CUDA Graph Trees
        # state, stashed so the backward threads it starts inherit it.
        tls.install_thread_state()
    _configure_compiler_for_thread(ctx.num_drafters)

    ctx.gate.acquire_capture()
    try:
        warming = "warming up" if ctx.cfg.runtime.compile == "eager" else "warming compiled graphs"
        ctx.log.line(stage_line(name, device, warming))
        started = time.perf_counter()
        _warm_up(ctx, replica)
        if replica.target is not None and ctx.workload.target_compiled(replica.target_device):
            ctx.workload.warm_target(replica.target, replica.target_device)  # sequential
        seconds = time.perf_counter() - started
        detail = ""
        if ctx.cfg.runtime.compile == "reduce-overhead" and replica.device.type == "cuda":
            replica.graphs_recorded = tls.recorded_graph_count()
            detail = f", {replica.graphs_recorded} CUDA graphs recorded"
        ctx.log.line(stage_line(name, device, f"ready (warm-up {seconds:.1f} s{detail})"))
    finally:
        ctx.gate.release_capture()
    ctx.gate.mark_warm()
    ctx.gate.wait_all_warm()
    # Every rank's drafter is warm (compile times differ: a store barrier, no timeout);
    # a SIGTERM seen on any rank during the warm-up stops them all here.
    if ctx.world.vote("warm", int(ctx.term_requested.is_set()), ctx.supervisor.check):
        ctx.term_requested.set()
    if replica.rank == 0 and ctx.is_lead:
        ctx.log.line(
            f"warm-up | {ctx.total_shards} drafters | all ready "
            f"{time.perf_counter() - ctx.warmup_started:.1f} s after warm-up began"
        )

    if ctx.term_requested.is_set():  # SIGTERM during warm-up: nothing trained, stop now
        ctx.supervisor.request_stop()
        return
    # Without this line a failure in a step would be reported in the "ready" stage.
    ctx.log.line(stage_line(name, device, "training"))
    if replica.rank == 0:
        ctx.meter.start()
    profile = (
        _ProfileWindow(ctx, replica) if replica.rank == 0 and ctx.cfg.debug.profile_steps else None
    )
    shard = ctx.shard_offset + replica.rank
    step = ctx.start_step - 1
    while (step := step + 1) < ctx.total_steps:  # a budget check may re-size the run
        waited = time.perf_counter()
        inputs = _next_inputs(ctx, replica)
        if inputs.step != step or inputs.shard != shard:
            raise RuntimeError(
                f"{name} expected step {step} shard {shard}, got step {inputs.step} shard {inputs.shard}"
            )
        inject(ctx, name, "step", step + 1)
        if profile is not None:
            profile.before(step + 1)
        stepped = time.perf_counter()
        if replica.rank == 0:
            ctx._wait_s += stepped - waited
        stop = _train_step(ctx, replica, inputs)
        if replica.rank == 0:
            ctx._step_s += time.perf_counter() - stepped
        if profile is not None:
            profile.after(step + 1)
        if ctx.budget is not None:
            _check_budget(ctx, replica, step + 1)
        if stop:
            break
        held = step + 1 == ctx.cfg.debug.hold_at_step and step + 1 < ctx.total_steps
        if held and ctx.debug_applies():  # on_ranks: one rank hangs, the others go on
            _hold_until_stopped(ctx, replica, step + 1)
            break
    if ctx.cfg.runtime.compile == "reduce-overhead" and replica.device.type == "cuda":
        replica.graphs_recorded = tls.recorded_graph_count()
    if replica.completed_steps < ctx.total_steps:
        # Stopped early on request: release the threads still feeding us.
        ctx.supervisor.request_stop()


def _check_budget(ctx: RunContext, replica: DrafterReplica, step_number: int) -> None:
    """train.budget_minutes: the lead times real steps and publishes a new step count;
    every replica of every rank takes it at the same step (budget.BudgetCheck)."""
    check = ctx.budget
    if replica.rank == 0 and ctx.is_lead:
        new_total = check.timed(step_number, ctx.meter.walks.spent)
        if new_total is not None:
            ctx.world.publish("budget-steps", str(new_total))
    if not check.applies_after(step_number):
        return
    total = int(ctx.world.read("budget-steps"))
    replica.optimizer.scheduler.resize(total)  # the cosine ends with the new count
    if replica.rank == 0:
        old, ctx.total_steps = ctx.total_steps, total
        ctx.meter.total_steps = ctx.cfg.train.steps = total
        if ctx.is_lead:
            ctx.log.line(check.line(old))


def _hold_until_stopped(ctx: RunContext, replica: DrafterReplica, step: int) -> None:
    """debug.hold_at_step: train no further until a stop arrives, so a test can stop or
    redeploy the run at a known step (no timing involved)."""
    if replica.rank == 0:
        ctx.log.line(f"debug: holding after step {step} until SIGTERM")
    while not ctx.term_requested.wait(0.05) and not ctx.supervisor.stop.is_set():
        pass


class _ProfileWindow:
    """Counts CUDA graph launches and kernel launches over debug.profile_steps [first, last]:
    proof that steady-state steps replay graphs instead of launching kernels one by one."""

    def __init__(self, ctx: RunContext, replica: DrafterReplica) -> None:
        first, last = (list(ctx.cfg.debug.profile_steps) + [0, 0])[:2]
        self.first, self.last = first, max(first, last)
        self.ctx, self.replica = ctx, replica
        self.profiler = None

    def before(self, step: int) -> None:
        if step == self.first:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if self.replica.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()

    def after(self, step: int) -> None:
        if self.profiler is None or step != self.last:
            return
        if self.replica.device.type == "cuda":
            torch.cuda.synchronize(self.replica.device)
        self.profiler.__exit__(None, None, None)
        graph_launches = kernel_launches = 0
        for event in self.profiler.events():
            if event.name.startswith("cudaGraphLaunch"):
                graph_launches += 1
            elif event.name.startswith(("cudaLaunchKernel", "cuLaunchKernel")):
                kernel_launches += 1
        steps = self.last - self.first + 1
        self.ctx.log.line(
            stage_line(
                self.replica.name,
                str(self.replica.device),
                f"profiled steps {self.first}-{self.last}: {graph_launches} CUDA graph launches, "
                f"{kernel_launches} kernel launches outside graphs ({steps} steps, all threads)",
            )
        )
        self.profiler = None
        # Collecting the trace took time that is no training: restart the throughput window.
        self.ctx.meter.restart_window()


def _configure_compiler_for_thread(num_drafters: int) -> None:
    # Dynamo caches per code object and guards on the module and device: N drafters
    # make N entries. Config overrides are per thread in torch 2.12+, so set them here.
    import torch._dynamo

    limit = max(8, 4 * num_drafters)
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(limit, getattr(torch._dynamo.config, key)))


def _warm_up(ctx: RunContext, replica: DrafterReplica) -> None:
    """Compile and run forward + backward + optimizer step with the production shapes
    (warm-up, record, replay), then put weights and optimizer back as they were."""
    inject(ctx, replica.name, "warmup")
    example = ctx.workload.example_inputs(replica.device)
    snapshot = replica.optimizer.snapshot()
    for _ in range(ctx.cfg.runtime.warmup_iters):
        loss, metrics = replica.loss_fn(*example.tensors())
        loss.backward()
        flatten([], [loss, *metrics.values()]).tolist()  # consume outputs as a real step does
        replica.optimizer.set_master_grads(replica.optimizer.model_grads())
        replica.optimizer.step()
    replica.optimizer.restore(snapshot)
    if replica.rank == 0 and ctx.is_lead:
        # The walk's first call pays one-off costs (3 s at 30M, 10 s at 8B: kernels and
        # memory for its shapes). Paid here, out of training time, the walk budget prices
        # the walks at what they cost from then on, and a run gets a curve of them.
        ctx.workload.serving_tau(replica.model, example)
    if ctx.cfg.debug.hold_in_warmup:
        if replica.rank == 0:
            ctx.log.line("debug: holding in warm-up until SIGTERM")
        while not ctx.term_requested.wait(0.05) and not ctx.supervisor.stop.is_set():
            pass


def _next_inputs(ctx: RunContext, replica: DrafterReplica) -> DrafterInputs:
    item = replica.inputs.get()
    if isinstance(item, DrafterInputs):  # pipelined: a target loop already ran the target
        if item.ready is not None:
            current = torch.cuda.current_stream(replica.device)
            current.wait_event(item.ready)
            for tensor in item.tensors():
                tensor.record_stream(current)  # made on the target loop's stream
        return item
    # sequential: the target forward runs here, then the drafter step (SpecForge online mode)
    with torch.no_grad():
        return _target_forward(ctx, replica.target, replica.target_device, item, replica.device)


def _train_step(ctx: RunContext, replica: DrafterReplica, inputs: DrafterInputs) -> bool:
    """One step: forward, backward, average with the other replicas, clip, update.
    Returns True when the run should stop after this step."""
    cfg = ctx.cfg
    step_number = inputs.step + 1
    serving_tau = None
    at_end = ctx.workload.walks_at_the_end
    if replica.rank == 0 and ctx.is_lead and ctx.meter.walk_due(step_number, at_end):
        # Before this step trains on the batch: its text is measured as a server meets it,
        # exactly, while that fits its share of the training time (tau~ itself comes
        # from the step's anchors, on every line).
        started = time.perf_counter()
        serving_tau = ctx.workload.serving_tau(replica.model, inputs)
        if serving_tau is not None:
            ctx.meter.walks.record(time.perf_counter() - started)
    loss, metrics = replica.loss_fn(*inputs.tensors())
    if step_number in cfg.debug.nonfinite_at_steps:
        loss = loss * float("nan")
    loss.backward()
    if cfg.debug.stop_at_step and step_number == cfg.debug.stop_at_step:
        ctx.term_requested.set()  # as if SIGTERM arrived during this step

    keys = sorted(metrics)
    extras = [loss.detach(), *(metrics[k].detach() for k in keys)]
    optimizer = replica.optimizer
    stats = ctx.averager.average(replica, extras)
    mean_loss, values = stats[0], _unflatten_metrics(keys, [metrics[k] for k in keys], stats[1:])

    if not math.isfinite(mean_loss):
        optimizer.skip_step()
        replica.nonfinite_count += 1
        replica.completed_steps = step_number
        if replica.rank == 0:
            stacks.step_done(step_number, ctx.total_steps)
        if replica.rank == 0 and ctx.is_lead:
            ctx.log.line(
                format_nonfinite_line(
                    step=step_number,
                    total=ctx.total_steps,
                    loss=mean_loss,
                    count=replica.nonfinite_count,
                    allowed=cfg.train.max_nonfinite,
                )
            )
        if replica.nonfinite_count > cfg.train.max_nonfinite:
            if replica.rank == 0 and ctx.is_lead:
                raise NonFiniteLoss(
                    f"{replica.nonfinite_count} non-finite losses, more than train.max_nonfinite="
                    f"{cfg.train.max_nonfinite}; last at step {step_number}"
                )
            return True
    else:
        lr = optimizer.lr
        grad_norm = optimizer.step()  # before clipping
        replica.completed_steps = step_number
        if replica.rank == 0:
            stacks.step_done(step_number, ctx.total_steps)
        if replica.rank == 0:
            ctx.history.append((step_number, mean_loss))
            if ctx.is_lead:
                logged = ctx.meter.add(
                    step_number,
                    loss=mean_loss,
                    tokens=inputs.num_tokens * ctx.total_shards,
                    metrics=values,
                    tau=ctx.workload.tau_estimate(values),
                    serving_tau=serving_tau,
                    serving_estimate=ctx.workload.serving_estimate(values),
                    lr=lr,
                    queue_depth=replica.inputs.qsize(),
                    queue_size=replica.inputs.maxsize,
                    grad_norm=grad_norm,
                )
                # Per-part times feed the GPU layout table, and averaging across ranks is
                # worth reading on CPU too; a one-process CPU demo need not read them.
                if logged and (replica.device.type == "cuda" or ctx.world.size > 1):
                    ctx.log.line(_timing_line(ctx, logged))

    every = cfg.train.checkpoint_every
    if replica.rank == 0 and every and step_number % every == 0 and ctx.on_checkpoint:
        if step_number < ctx.total_steps:
            ctx.on_checkpoint(step_number)
    if (
        replica.rank == 0
        and ctx.is_lead
        and cfg.eval.enabled
        and cfg.eval.every
        and step_number % cfg.eval.every == 0
        and step_number < ctx.total_steps  # the last step's eval is the end-of-run one
        and ctx.on_eval is not None
    ):
        ctx.on_eval(step_number, replica.model)
    return ctx.averager.stop_after_step


def _unflatten_metrics(keys: list[str], shapes: list[torch.Tensor], values: list[float]) -> dict:
    out, offset = {}, 0
    for key, like in zip(keys, shapes, strict=False):
        n = like.numel()
        chunk = values[offset : offset + n]
        out[key] = chunk[0] if like.dim() == 0 else chunk
        offset += n
    return out


def _timing_line(ctx: RunContext, steps: int) -> str:
    """Per-part times of the window (the 8-GPU layout table is computed from these):
    ``timing | drafter step 170.2 ms | waiting for inputs 260.1 ms | grad averaging
    12.4 ms (4200.0 MB float32, nccl (in process)) | target forward 265.0 ms``."""
    n = max(1, steps)
    parts = [
        f"drafter step {1000 * ctx._step_s / n:.1f} ms",
        f"waiting for inputs {1000 * ctx._wait_s / n:.1f} ms",
    ]
    ctx._step_s = ctx._wait_s = 0.0
    averaging = ctx.averager.timer.take_mean_ms()
    if averaging is not None:
        dtype = str(ctx.averager.comm_dtype).replace("torch.", "")
        parts.append(
            f"grad averaging {averaging:.1f} ms ({ctx.averager.payload_bytes / 1e6:.1f} MB "
            f"{dtype}, {ctx.averager.method})"
        )
    target = ctx.target_timer.take_mean_ms() if ctx.target_timer is not None else None
    if target is not None:
        parts.append(f"target forward {target:.1f} ms")
    return "timing | " + " | ".join(parts)
