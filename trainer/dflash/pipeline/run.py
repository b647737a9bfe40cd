"""Wires a run together: replicas, queues, threads, signals, checkpoints, the end of run.

``train()`` returns a ``TrainResult`` instead of exiting so tests can run it in process;
the entry point turns it into an exit status (exiting without interpreter teardown after
a failure or while a thread is still alive: see train_dflash_pipeline.exit_without_teardown).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.pipeline import checkpointing as ckpt
from dflash.pipeline.distributed import PeerFailure, World
from dflash.pipeline.logging import RunLog, header_lines
from dflash.pipeline.meter import StepMeter
from dflash.pipeline.metrics_file import MetricsWriter, metrics_dir
from dflash.pipeline.optim import MasterWeightAdamW
from dflash.pipeline.supervisor import StopQueue, Supervisor
from dflash.pipeline.threads import (
    DrafterReplica,
    RunContext,
    run_drafter,
    run_prefetcher,
    run_target_loop,
)
from dflash.pipeline.trackers import open_trackers
from dflash.pipeline.train_config import (
    TrainConfig,
    parse_fail_in,
    steps_for_epochs,
)
from dflash.pipeline.warmup import WarmupGate
from dflash.pipeline.workload import Workload

REPEAT_WINDOW_S = 2.0  # a second SIGTERM this soon after the first is the same request
STOP_GRACE_S = 8.0  # every thread joined within this after a stop (the run must end within 10 s)

# Dense bf16 peak per GPU, for mfu (vendor datasheets).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


@dataclass
class TrainResult:
    exit_code: int
    completed_steps: int = 0
    history: list[tuple[int, float]] = field(default_factory=list)
    checkpoint: Path | None = None
    stuck_threads: list[str] = field(default_factory=list)
    replicas: list[DrafterReplica] = field(default_factory=list)
    eval_line: str | None = None
    graphs_recorded: list[int] = field(default_factory=list)
    failure: BaseException | None = None  # what ended a failed run (the first thread's)


def compile_loss(module: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "eager":
        return module
    if mode == "default":
        return torch.compile(module)
    if mode == "reduce-overhead":
        return torch.compile(module, mode="reduce-overhead")
    if mode == "legacy-cudagraphs":
        # Per-graph CUDA graphs without the trees; never touches their thread-local state.
        return torch.compile(
            module, options={"triton.cudagraphs": True, "triton.cudagraph_trees": False}
        )
    raise ValueError(f"unknown compile mode {mode!r}")


def config_differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs."""
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            changed.append(f"{prefix}{key}")
    return changed


def peak_flops(cfg: TrainConfig) -> float | None:
    devices = list(dict.fromkeys(cfg.runtime.target_devices + cfg.runtime.drafter_devices))
    if cfg.runtime.peak_tflops:
        return cfg.runtime.peak_tflops * 1e12 * len(devices)
    total = 0.0
    for dev in devices:
        if not dev.startswith("cuda") or not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(torch.device(dev))
        match = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
        if match is None:
            return None
        total += match * 1e12
    return total


def train(
    cfg: TrainConfig,
    workload: Workload,
    log: RunLog,
    *,
    resume: bool = False,
    resume_state: ckpt.TrainingState | None = None,
    resume_folder: Path | None = None,
    source_dir: Path | None = None,
    handle_signals: bool = True,
    interrupts: Interrupts | None = None,
    world: World | None = None,
) -> TrainResult:
    """Train; ``interrupts`` (SIGTERM/SIGINT state) may be installed by the caller before
    the slow set-up, so a stop during it is not lost. ``world``: this process's place in
    the job (see distributed.py; default: a world of one)."""
    interrupts = interrupts or Interrupts(log)
    world = world or World()
    if handle_signals:
        interrupts.install()
    folder = metrics_dir(cfg.resolved_output_dir())
    # One metrics file, one TensorBoard folder and one tracker run per job: rank 0's, as
    # it alone writes the step lines (another rank's start record, with its own devices,
    # would read as the run's config and as a second start).
    metrics = (
        MetricsWriter(
            folder,
            tensorboard=cfg.logging.tensorboard,
            trackers=open_trackers(cfg.logging, folder),
        )
        if world.is_main
        else None
    )
    try:
        result = _train(
            cfg,
            workload,
            log,
            resume=resume,
            resume_state=resume_state,
            resume_folder=resume_folder,
            source_dir=source_dir,
            interrupts=interrupts,
            world=world,
            metrics=metrics,
        )
        if result.exit_code == 0 and not result.stuck_threads:
            try:
                world.finish()  # every rank leaves together (rank 0 may still evaluate)
            except PeerFailure as exc:
                log.line(f"training failed: {world.label()}: {exc}")
                result.exit_code = 1
        return result
    finally:
        if metrics is not None:
            metrics.close()
        if handle_signals:
            interrupts.restore()


def _train(
    cfg: TrainConfig,
    workload: Workload,
    log: RunLog,
    *,
    resume: bool,
    source_dir: Path | None,
    interrupts: Interrupts,
    resume_state: ckpt.TrainingState | None = None,
    resume_folder: Path | None = None,
    metrics: MetricsWriter | None,
    world: World,
) -> TrainResult:
    runtime = cfg.runtime  # validated when loaded: the device layout included
    world.check_layout(runtime)
    if runtime.threads:
        torch.set_num_threads(runtime.threads)
    output_dir = cfg.resolved_output_dir()
    devices = runtime.target_devices + runtime.drafter_devices
    if world.is_main:
        for row in header_lines(cfg.to_dict(), devices, source_dir or Path.cwd()):
            log.line(row)
        for row in workload.describe():
            log.line(row)
        log.line(f"output_dir: {output_dir}")
    for row in world.describe(runtime):
        log.line(row)

    if resume_state is None and resume:
        # In-process callers (tests); the entry point has already taken rank 0's choice
        # for every rank (resume.py) and passes resume_state.
        found = ckpt.latest_checkpoint(output_dir)
        if found is None:
            log.line(f"resume: no checkpoint under {output_dir}; starting at step 0")
        else:
            resume_state = ckpt.load_checkpoint(found)
            log.line(f"resume: continuing from {found} (step {resume_state.step})")
    if resume_state is not None:
        if resume_folder is not None:
            log.line(f"resume: continuing from {resume_folder} (step {resume_state.step})")
        changed = config_differences(resume_state.config, cfg.to_dict())
        if changed:
            log.line("resume: config differs from the checkpoint's in " + ", ".join(changed))

    supervisor = Supervisor(log)
    world.connect(supervisor)
    term = interrupts.term
    drafter_devices = [torch.device(d) for d in runtime.drafter_devices]
    target_devices = [torch.device(d) for d in runtime.target_devices]
    num_drafters = len(drafter_devices)
    start_step = resume_state.step if resume_state else 0
    budget_check = None
    if cfg.train.budget_minutes is not None:  # sizes cfg.train.steps (epochs then unused)
        from dflash.budget import BudgetCheck, size_to_budget

        deadline, probe_s = size_to_budget(cfg, workload, num_drafters, world.size, log.line)
        if world.size > 1:  # every rank probed its own devices: rank 0's count rules
            if world.is_main:
                world.publish("budget-probe-steps", str(cfg.train.steps))
            cfg.train.steps = int(world.read("budget-probe-steps"))
            if not world.is_main:
                log.line(f"train.budget_minutes: {cfg.train.steps} steps, rank 0's count")
        budget_check = BudgetCheck(
            deadline, start_step, cfg.train.steps, runtime.queue_size, probe_s=probe_s
        )
    elif cfg.train.epochs is not None:
        per_step = cfg.data.batch_size * num_drafters * world.size
        cfg.train.steps = steps_for_epochs(cfg.train.epochs, workload.num_samples(), per_step)
        log.line(
            f"train.epochs {cfg.train.epochs:g}: {cfg.train.steps} steps "
            f"({workload.num_samples()} samples, {per_step} a step)"
        )
    total_steps = cfg.train.steps

    # ---- models (targets: built once per device and kept by the workload)
    replicas: list[DrafterReplica] = []
    for rank, device in enumerate(drafter_devices):
        torch.manual_seed(cfg.seed)  # identical initial weights on every replica
        model = workload.build_drafter(device)
        if replicas:
            ckpt.load_trainable_state(model, ckpt.trainable_state(replicas[0].model))
        optimizer = MasterWeightAdamW(model.parameters(), cfg.optim, total_steps)
        if resume_state is not None:
            ckpt.load_trainable_state(model, resume_state.model)
            optimizer.load_state_dict(resume_state.optimizer)
        replica = DrafterReplica(
            rank=rank,
            device=device,
            model=model,
            loss_fn=compile_loss(workload.loss_module(model), runtime.compile),
            optimizer=optimizer,
            inputs=StopQueue(runtime.queue_size, supervisor),
        )
        # A run stopped before its first step (during warm-up, say) stands where it
        # started: the resumed step, not 0 (else its stop would checkpoint "step 0").
        replica.completed_steps = start_step
        if resume_state is not None:
            replica.nonfinite_count = resume_state.nonfinite_count
        if runtime.schedule == "sequential":
            replica.target_device = target_devices[rank % len(target_devices)]
            replica.target = workload.target_for(replica.target_device)
        replicas.append(replica)
    if runtime.schedule == "pipelined":
        for device in target_devices:
            workload.target_for(device)
    if cfg.train.tau_walk_rows and (walk_line := workload.prepare_walk()):
        log.line(walk_line)
    if resume_state is not None:
        ckpt.restore_rng(resume_state.rng)

    comm_dtype = getattr(torch, runtime.grad_comm_dtype)
    averager = world.averager(
        num_drafters, supervisor, term.is_set, comm_dtype, runtime.grad_bucket_mb
    )
    ctx = RunContext(
        cfg=cfg,
        workload=workload,
        log=log,
        supervisor=supervisor,
        # Compiled target loops warm up at the gate too (sequential: in their drafter).
        gate=WarmupGate(num_drafters + _compiled_target_loops(cfg, workload), supervisor),
        averager=averager,
        world=world,
        term_requested=term,
        replicas=replicas,
        start_step=start_step,
        total_steps=total_steps,
        meter=StepMeter(
            log,
            total_steps=total_steps,
            log_every=cfg.train.log_every,
            # every rank's drafters and devices alike: this process's times the ranks
            flops_per_step=workload.flops_per_batch() * num_drafters * world.size,
            target_flops_per_step=workload.target_flops_per_batch() * num_drafters * world.size,
            peak_flops=(peak_flops(cfg) or 0.0) * world.size or None,
            writer=metrics,
            walk_budget=cfg.train.tau_walk_budget,
            walk_set=workload.walk_set_label,
            walk_cover=workload.walks_to_cover,
        ),
        fail_point=parse_fail_in(cfg.debug.fail_in) if cfg.debug.fail_in else None,
        hang_point=parse_fail_in(cfg.debug.hang_in, "debug.hang_in") if cfg.debug.hang_in else None,
        budget=budget_check,
    )
    ctx.meter.record_start(cfg.to_dict(), start_step)

    # Rank 0 writes (in the background for periodic checkpoints); the other ranks never
    # write, and wait at a store barrier for the checkpoints every rank must see complete.
    writer = ckpt.CheckpointWriter(output_dir, log.line) if world.is_main else None
    saves = [0]  # every rank saves at the same steps: the count names the store barrier

    def collect(step: int) -> ckpt.TrainingState:
        lead = replicas[0]
        return ckpt.TrainingState(
            step=step,
            model=ckpt.live_trainable_state(lead.model),
            optimizer=lead.optimizer.state_dict(live=True),
            config=cfg.to_dict(),
            rng=ckpt.capture_rng(),
            nonfinite_count=lead.nonfinite_count,
        )

    def save(step: int, export: bool = True) -> Path:
        """Wait for any write in flight, then write this one (end of run, SIGTERM); under
        torchrun every rank returns once rank 0's checkpoint is complete."""
        saves[0] += 1
        path = ckpt.checkpoint_dir(output_dir, step)
        if writer is not None:
            exporter = workload.export_weights if export else None
            path = writer.save(step, lambda: collect(step), exporter)
        world.barrier(f"checkpoint-{saves[0]}")
        return path

    def save_periodic(step: int) -> None:
        """Snapshot and go on training; the write finishes in the background (rank 0
        only: nobody reads a periodic checkpoint before a resume, which waits for it)."""
        if writer is not None:
            writer.save_async(step, lambda: collect(step), workload.export_weights, if_busy="skip")

    ctx.on_checkpoint = save_periodic
    ctx.checkpoint_settled = writer.wait if writer is not None else None

    def eval_periodic(step: int, drafter) -> None:
        """Speculative decoding of the held-out prompts with the live drafter (drafter-0's
        thread, between steps): where serving acceptance goes while tau~ rises."""
        was_training = drafter.training
        drafter.eval()
        started = time.perf_counter()
        try:
            evaluation = workload.evaluate(drafter)
        finally:
            drafter.train(was_training)
        seconds = time.perf_counter() - started
        if ctx.budget is not None:
            ctx.budget.exclude(seconds)  # an eval's time is not what a step costs
        if evaluation is None:
            return
        # What it cost: the step lines' throughput leaves the eval out (restart_window).
        log.line(
            f"eval at step {step} | "
            + evaluation.format_line().removeprefix("eval | ")
            + f" | {seconds:.1f} s of training time"
        )
        ctx.meter.record_eval({**evaluation.metrics(), "during_training": True}, step=step)
        ctx.meter.restart_window()  # the eval's time is no training throughput

    ctx.on_eval = eval_periodic

    if world.vote("setup", int(term.is_set())):
        term.set()  # SIGTERM reached some rank during the set-up: every rank stops here
    if not term.is_set():
        _start_from_rank0_weights(replicas[0], world)
    if term.is_set():
        log.line("stopped before training started: nothing trained, no checkpoint written")
        return TrainResult(exit_code=0, completed_steps=start_step, replicas=replicas)
    interrupts.abandon = supervisor.request_stop

    # ---- threads (drafters first: they warm up while everything else waits at the gate)
    ctx.warmup_started = time.perf_counter()
    drafter_threads = [
        supervisor.spawn(r.name, lambda r=r: run_drafter(ctx, r), str(r.device)) for r in replicas
    ]
    pin = any(d.type == "cuda" for d in target_devices + drafter_devices)
    if runtime.schedule == "pipelined":
        batch_queues = [StopQueue(runtime.queue_size, supervisor) for _ in target_devices]
        shard_queues = [batch_queues[j % len(target_devices)] for j in range(num_drafters)]
        supervisor.spawn("prefetcher", lambda: run_prefetcher(ctx, shard_queues, pin))
        for i, device in enumerate(target_devices):
            owned = sum(1 for j in range(num_drafters) if j % len(target_devices) == i)
            supervisor.spawn(
                f"target-{i}",
                lambda i=i, device=device, owned=owned: run_target_loop(
                    ctx, i, device, workload.target_for(device), batch_queues[i], owned
                ),
                str(device),
            )
    else:
        supervisor.spawn(
            "prefetcher", lambda: run_prefetcher(ctx, [r.inputs for r in replicas], pin)
        )

    watch = drafter_threads
    while any(t.is_alive() for t in watch) and not supervisor.stop.is_set():
        for thread in watch:
            thread.join(timeout=0.1)
    supervisor.request_stop()  # release whatever still waits on a queue or the gate
    stuck = supervisor.join_all(STOP_GRACE_S)
    interrupts.abandon = None
    if writer is not None:
        try:
            writer.wait()  # a periodic checkpoint still being written completes first
        except Exception:  # noqa: BLE001 - the writer logged it; the next is written anew
            pass

    result = TrainResult(
        exit_code=0,
        completed_steps=replicas[0].completed_steps,
        history=list(ctx.history),
        replicas=replicas,
        stuck_threads=stuck,
        graphs_recorded=[r.graphs_recorded for r in replicas],
    )
    if stuck:
        log.line(
            f"threads still running {STOP_GRACE_S:.0f} s after the stop: {', '.join(stuck)}; exiting"
        )
    if supervisor.failed:
        name, exc = supervisor.failures[0]
        where = world.where()
        device = supervisor.devices.get(name)
        on = f" on {device}" if device else ""
        log.line(f"training failed{where}: {name}{on} failed: {type(exc).__name__}: {exc}")
        result.exit_code = 1
        result.failure = exc
        return result
    if stuck:
        result.exit_code = 1
        return result

    _log_device_summary(cfg, replicas, log)
    lead, total_steps = replicas[0], ctx.total_steps  # a budget check may have re-sized it
    if lead.completed_steps < total_steps:
        why = (
            (interrupts.signal_name or "SIGTERM") if term.is_set() else world.stop_cause_elsewhere()
        )
        if lead.completed_steps <= start_step:
            log.line(
                f"stopped by {why} before the first step: nothing trained, no checkpoint written"
            )
            return result
        # Weights, optimizer and schedule only: the drafter export waits for a normal end,
        # so the checkpoint fits in the grace period the stop gives us.
        result.checkpoint = save(lead.completed_steps, export=False)
        log.line(
            f"stopped by {why} after step {lead.completed_steps}/{total_steps}; "
            f"a redeploy continues from it (checkpoint {_written_where(result.checkpoint, world)})"
        )
        return result
    if cfg.train.final_checkpoint:
        result.checkpoint = save(lead.completed_steps)
    if ctx.meter.final_loss is not None:
        log.line(
            f"final loss {ctx.meter.final_loss:.4f} (mean of the last {cfg.train.log_every} steps)"
        )
    if cfg.eval.enabled and world.is_main:
        # The saved checkpoint read back from disk, so the line is what a fresh process
        # measures (python -m dflash.evaluate); the in-memory drafter only without one.
        evaluation, where = None, ""
        if result.checkpoint is not None:
            evaluation = workload.evaluate_checkpoint(result.checkpoint)
        if evaluation is None:
            lead.model.eval()
            evaluation = workload.evaluate(lead.model)
            lead.model.train()
            where = " | drafter in memory (no checkpoint written)"
        if evaluation is not None:
            result.eval_line = evaluation.format_line() + where
            log.line(result.eval_line)
            ctx.meter.record_eval(evaluation.metrics(), step=lead.completed_steps)
    if result.checkpoint is not None:
        log.line(f"drafter checkpoint: {_written_where(result.checkpoint, world)}")
    log.line("training complete")
    return result


def _compiled_target_loops(cfg: TrainConfig, workload: Workload) -> int:
    if cfg.runtime.schedule != "pipelined":
        return 0
    return sum(1 for d in cfg.runtime.target_devices if workload.target_compiled(torch.device(d)))


def _written_where(checkpoint: Path, world: World) -> str:
    """Only rank 0 writes checkpoints: another rank (perhaps on another host, whose own
    output_dir stays empty) names rank 0's, not a path of its own."""
    return str(checkpoint) if world.is_main else f"{checkpoint.name}, written by rank 0"


def _start_from_rank0_weights(replica: DrafterReplica, world: World) -> None:
    """Every rank starts from rank 0's weights (the same seed gives the same weights on one
    torch build; this makes it so on any). Before any thread runs: no capture to disturb.
    A world of one keeps its own (the copy back is then exact: the masters are its own)."""
    optimizer = replica.optimizer
    with torch.no_grad():
        world.broadcast_from_main(optimizer.masters)
        if optimizer.uses_master:
            torch._foreach_copy_([p.data for p in optimizer.params], optimizer.masters)


def _log_device_summary(cfg: TrainConfig, replicas: list[DrafterReplica], log: RunLog) -> None:
    """How CUDA graphs were used and how much memory the run took."""
    if cfg.runtime.compile in ("reduce-overhead", "legacy-cudagraphs"):
        from torch._dynamo.utils import counters

        skips = counters["inductor"]["cudagraph_skips"]
        for r in replicas:
            if r.device.type == "cuda":
                recorded = ""
                if cfg.runtime.compile == "reduce-overhead":
                    recorded = f"{r.graphs_recorded} CUDA graphs recorded in its trees; "
                log.line(f"{r.name} on {r.device}: {recorded}cudagraph skips {skips}")
    devices = dict.fromkeys(cfg.runtime.target_devices + cfg.runtime.drafter_devices)
    for dev in devices:
        if dev.startswith("cuda") and torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated(torch.device(dev)) / 2**30
            log.line(f"peak GPU memory {dev}: {peak:.1f} GiB")


class Interrupts:
    """SIGTERM/SIGINT: the first asks to stop after the current step and checkpoint; a
    second abandons the current step (the checkpoint then holds the last finished one)."""

    def __init__(self, log: RunLog) -> None:
        self.log = log
        self.term = threading.Event()
        self.abandon: Callable[[], None] | None = None
        self._previous: dict = {}
        self._first_at = 0.0
        self.signal_name: str | None = None  # the first stop signal: SIGTERM or SIGINT

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if not self.term.is_set():
            self.term.set()
            self._first_at = time.monotonic()
            self.signal_name = name
            self.log.line(f"received {name}: finishing the current step, then writing a checkpoint")
        elif signum == signal.SIGTERM and time.monotonic() - self._first_at < REPEAT_WINDOW_S:
            # One stop told twice: `dflashctl stop` signals the process group, and torchrun,
            # in it, passes the SIGTERM on to its ranks once more.
            self.log.line(f"received {name} again at once: taken as the same stop request")
        elif self.abandon is not None:
            self.log.line(f"received {name} again: abandoning the current step")
            self.abandon()
