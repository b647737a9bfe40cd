"""Train a DFlash drafter: threaded, compiled, TLS-safe CUDA Graph Trees warm-up.

    cd trainer && python train_dflash_pipeline.py --config configs/tiny-cpu.yaml \
        [--set train.steps=200 --set output_dir=/tmp/out] [--resume | --resume-from CKPT]

dflashctl continues a replaced run by setting DFLASH_RESUME_FROM to its latest
checkpoint folder (see dflash/pipeline/resuming.py).

The same script is the entry point of every rank under torchrun (one process per GPU,
any number of hosts; see dflash/pipeline/distributed.py):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        train_dflash_pipeline.py --config configs/qwen3-8b.yaml

Exit status: 0 finished (or stopped by SIGTERM after writing a checkpoint), 1 a thread
failed (its traceback is in the log), 2 the config is wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

try:
    from dflash.pipeline.logging import RunLog
    from dflash.pipeline.train_config import TrainConfig, TrainConfigError, load_train_config
except ModuleNotFoundError as exc:  # the container's python lacks a trainer dependency
    if exc.name not in ("pydantic", "pydantic_core", "yaml", "torch", "transformers"):
        raise
    sys.exit(
        f"setup error: {sys.executable} cannot import {exc.name}, which the trainer needs; "
        f"install the trainer's dependencies there: {sys.executable} -m pip install "
        "torch transformers safetensors 'pydantic>=2.6' pyyaml"
    )

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config", required=True, help="trainer config YAML, e.g. configs/tiny-cpu.yaml"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key (dotted path), e.g. train.steps=200; repeatable",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in output_dir"
    )
    parser.add_argument(
        "--resume-from",
        metavar="CHECKPOINT",
        help="continue from this checkpoint folder (default: $DFLASH_RESUME_FROM; empty: none)",
    )
    return parser.parse_args(argv)


def default_workload(cfg: TrainConfig):
    from dflash.pipeline.dflash_workload import DFlashWorkload

    return DFlashWorkload(cfg)


def main(argv: Sequence[str] | None = None, workload_factory: Callable | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_train_config(args.config, args.set)
    except TrainConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG

    # Every check of the config itself (device layout included) has run by now; what is
    # left needs the target's config.json or the data, and the workload checks those
    # before it builds the target.
    import torch
    from dflash.pipeline import distributed
    from dflash.pipeline.error_file import record_exception
    from dflash.pipeline.run import Interrupts, train

    info = distributed.DistInfo.from_env()
    if info.enabled:  # torchrun: this process takes its local rank's share of the GPUs
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for key in ("target_devices", "drafter_devices"):
            shifted = distributed.shift_devices(getattr(cfg.runtime, key), info, count)
            setattr(cfg.runtime, key, shifted)
        drafter = torch.device(cfg.runtime.drafter_devices[0])
        if drafter.type == "cuda":
            torch.cuda.set_device(drafter)  # NCCL's device, and no stray context on cuda:0
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)

    from dflash.pipeline.resume_across_ranks import agree_on_resume, choose_on_lead
    from dflash.pipeline.resuming import StartOver, load_for_resume, resume_folder, resume_line

    resume_state = None
    start_over = None  # the log line when a finished run's checkpoint is not continued
    folder = None if args.resume else resume_folder(args.resume_from)
    lead_choice = None
    if info.enabled:
        # Rank 0 decides for every rank (agree_on_resume, after the rendezvous); it checks
        # its choice now, before minutes of set-up: a misfit is reported in seconds.
        if info.is_lead:
            lead_choice = choose_on_lead(cfg, args.resume, folder)
            if lead_choice.error is not None:
                print(f"config error: {lead_choice.error}", file=sys.stderr, flush=True)
    elif folder is not None:
        try:  # before minutes of set-up: a checkpoint that does not fit fails in seconds
            resume_state = load_for_resume(folder, cfg)
        except StartOver as over:
            start_over, folder = str(over), None
        except TrainConfigError as exc:
            print(f"config error: {exc}", file=sys.stderr, flush=True)
            return EXIT_CONFIG

    log = distributed.RankLog(info.rank) if info.enabled else RunLog()
    # Every thread's stack on request (`dflashctl stacks`) and when the steps stop.
    from dflash.pipeline import stacks
    from dflash.pipeline.metrics_file import metrics_dir

    stacks.install(metrics_dir(cfg.resolved_output_dir()), info.rank, log)
    if resume_state is not None:
        log.line(resume_line(folder, resume_state))
    if start_over is not None:
        log.line(start_over)
    # Before the slow set-up (building the target, making data): a stop then is not lost.
    interrupts = Interrupts(log)
    interrupts.install()
    coordinator = None
    try:
        if info.enabled:
            coordinator = distributed.Coordinator(
                info,
                log,
                backend=distributed.backend_for(
                    cfg.runtime.drafter_devices, cfg.runtime.dist_backend
                ),
                timeout_s=cfg.runtime.dist_timeout_s,
            )
            coordinator.start_monitor(cfg.runtime.peer_timeout_s)
            resume_state, folder = agree_on_resume(
                coordinator, log, cfg, choice=lead_choice, own_folder=folder
            )
        workload = (workload_factory or default_workload)(cfg)
        result = train(
            cfg,
            workload,
            log,
            resume=args.resume and not info.enabled,  # under torchrun rank 0 chose above
            resume_state=resume_state,
            resume_folder=folder,
            source_dir=HERE,
            handle_signals=False,
            interrupts=interrupts,
            coordinator=coordinator,
        )
    except TrainConfigError as exc:
        if lead_choice is None or lead_choice.error is None:  # rank 0 printed its own at once
            print(f"config error: {exc}", file=sys.stderr, flush=True)
        if coordinator is not None:
            coordinator.post_failure(f"config error: {exc}")
        return EXIT_CONFIG
    except Exception as exc:  # set-up or the end of the run failed: same report format
        log.block("main failed:\n" + traceback.format_exc())
        record_exception(exc)
        if coordinator is not None:
            coordinator.post_failure(f"main failed: {type(exc).__name__}: {exc}")
            distributed.abort_collectives()
        exit_without_teardown(EXIT_FAILED)
    finally:
        interrupts.restore()
        stacks.uninstall()
    if coordinator is not None and (result.exit_code != EXIT_OK or result.stuck_threads):
        distributed.abort_collectives()
    if result.failure is not None:
        record_exception(result.failure)
    if result.exit_code != EXIT_OK or result.stuck_threads:
        # The run has logged why it failed and joined its threads (up to run.STOP_GRACE_S).
        exit_without_teardown(result.exit_code or EXIT_FAILED)
    if threading.active_count() > 1:
        exit_without_teardown(result.exit_code)
    return result.exit_code  # clean finish (or a stop with its checkpoint written)


def exit_without_teardown(code: int) -> NoReturn:
    """Flush and end the process with ``code``, skipping interpreter teardown.

    A thread may still be alive here: stuck in a call we cannot interrupt (a long
    compile), or just finishing inside torch's C++ code after a failure. A normal exit
    finalizes the interpreter under it; the thread is then unwound out of torch's C++
    frames, which ends in "terminate called without an active exception" and SIGABRT
    (exit 134) instead of our status. Nothing is lost by skipping teardown: every log
    line is flushed as it is written and checkpoints are complete (written, then renamed)
    before train() returns.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def recorded(entry: Callable[[], int]) -> Callable[[], int | None]:
    """`entry` under torchelastic's `record`: an exception leaving it is written to the
    error file torchrun names in its root cause (see dflash/pipeline/error_file.py)."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:  # a torch without torch.distributed
        return entry
    return record(entry)


if __name__ == "__main__":
    raise SystemExit(recorded(main)())
