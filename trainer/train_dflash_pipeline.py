"""Train a DFlash drafter: threaded, compiled, TLS-safe CUDA Graph Trees warm-up.

    cd trainer && python train_dflash_pipeline.py --config configs/tiny-cpu.yaml \
        [--set train.steps=200 --set output_dir=/tmp/out] [--resume | --resume-from CKPT]

dflashctl continues a replaced run by setting DFLASH_RESUME_FROM to its latest
checkpoint folder (see dflash/pipeline/resume.py).

The same script is the entry point of every rank under torchrun (one process per GPU,
any number of hosts); a plain run is rank 0 of a world of one, on the same path (see
dflash/pipeline/distributed.py):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        train_dflash_pipeline.py --config configs/qwen3-8b.yaml

Exit status: 0 finished (or stopped by SIGTERM after writing a checkpoint), 1 a thread
failed (its traceback is in the log), 2 the config is wrong.

With DFLASH_CHECK_CONFIG=1 it only reads the config (the file, every --set and the
packages the trackers it enables need) and exits 0 or 2, in well under a second (torch is
not imported): dflashctl runs it so in the container, with the new release and the run's
interpreter, before it stops the old run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

try:
    from dflash.pipeline.train_config import TrainConfig, TrainConfigError, load_train_config
except ModuleNotFoundError as exc:  # the container's python lacks a trainer dependency
    if exc.name not in ("pydantic", "pydantic_core", "yaml", "torch", "transformers"):
        raise
    sys.exit(
        f"setup error: {sys.executable} cannot import {exc.name}, which the trainer needs; "
        f"install the trainer's dependencies there: {sys.executable} -m pip install "
        "torch transformers safetensors 'pydantic>=2.6' pyyaml"
    )

EXIT_CONFIG = 2  # process_exit.EXIT_CONFIG, before torch is imported (a config error is quick)
CHECK_CONFIG = "DFLASH_CHECK_CONFIG"  # set to 1: read the config, then exit (see above)
# Naming DFLASH_START_GATE tells dflashctl that this trainer prints a `rendezvous:` line
# on every node once every rank is past the rendezvous (World.started), so that
# `deploy --detach` waits for it before it says the run started.


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


def default_workload(cfg: TrainConfig, say: Callable[[str], None] | None = None):
    from dflash.dflash_workload import DFlashWorkload

    return DFlashWorkload(cfg, say=say)


def main(argv: Sequence[str] | None = None, workload_factory: Callable | None = None) -> int:
    """Parse the config, build the world, the workload and the run, train, and close."""
    args = parse_args(argv)
    try:
        cfg = load_train_config(args.config, args.set)
    except TrainConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    if os.environ.get(CHECK_CONFIG) == "1":
        print(f"config ok: {args.config}", flush=True)
        return 0

    # Every check of the config itself (device layout included) has run by now; what is
    # left needs the target's config.json or the data, and the workload checks those
    # before it builds the target.
    if os.environ.get("RANK", "0") == "0":  # the silence before the first line, explained
        print("start-up: importing torch", flush=True)
    from dflash.pipeline import process_exit, resume, stacks
    from dflash.pipeline.distributed import World
    from dflash.pipeline.metrics_file import metrics_dir
    from dflash.pipeline.run import Interrupts, train

    world = World.from_env()  # torchrun's variables, or none: rank 0 of a world of one
    world.place(cfg.runtime)
    # Rank 0 checks its checkpoint now, before minutes of set-up (and the rendezvous):
    # a misfit is reported in seconds.
    choice = resume.choose(world, cfg, args.resume, args.resume_from)
    log = world.run_log()
    if choice.error is not None:  # every rank hears it after the rendezvous, then exits 2
        print(f"config error: {choice.error}", file=sys.stderr, flush=True)
    else:  # a process that will exit 2 writes nothing: its output_dir stays as it was
        # Every thread's stack on request (`dflashctl stacks`) and when the steps stop.
        stacks.install(metrics_dir(cfg.resolved_output_dir()), world.rank, log)
    # Before the slow set-up (building the target, making data): a stop then is not lost.
    interrupts = Interrupts(log)
    interrupts.install()
    try:
        world.join(log, cfg.runtime)
        resume_state, folder = resume.agree(world, log, cfg, choice)
        world.started(log)  # the line deploy --detach waits for: DFLASH_START_GATE
        if workload_factory is not None:
            workload = workload_factory(cfg)
        else:
            workload = default_workload(cfg, log.line if world.is_main else None)
        result = train(
            cfg,
            workload,
            log,
            resume_state=resume_state,
            resume_folder=folder,
            source_dir=HERE,
            handle_signals=False,
            interrupts=interrupts,
            world=world,
        )
    except TrainConfigError as exc:
        return process_exit.config_error(exc, world, printed=choice.error is not None)
    except Exception as exc:  # set-up or the end of the run failed: same report format
        process_exit.crashed(world, log, exc)
    finally:
        interrupts.restore()
        stacks.uninstall()
        world.close()
    return process_exit.run_status(world, result)


if __name__ == "__main__":
    if os.environ.get(CHECK_CONFIG) == "1":  # no torch, so no torchelastic error file either
        raise SystemExit(main())
    from dflash.pipeline.process_exit import recorded

    raise SystemExit(recorded(main)())
