"""Evaluate a saved drafter: speculative decoding on held-out prompts, checked against greedy.

    cd trainer && python -m dflash.evaluate --checkpoint OUT/checkpoints/step-000600 \
        [--config configs/tiny-cpu.yaml] [--set target.path=/models/qwen3-8b] \
        [--float32-verify] [--device cuda:0]

The checkpoint is a training step folder (holding drafter/ and the run's config) or a
bare drafter folder (ours or a published one; then --config names the target and data).
Prompts are the run's held-out ones (see eval.* in the trainer config), so the line equals
the one the run logged at its end. Per-prompt results go beside the checkpoint
(eval.json, or eval-float32.json with --float32-verify: the target then verifies and
decodes greedily in float32, where near-ties no longer flip).

Exit status: 0 evaluated, 2 bad input (not a checkpoint, wrong config).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m dflash.evaluate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--checkpoint", required=True, help="step folder or drafter folder")
    parser.add_argument(
        "--config", help="trainer config YAML (default: the one saved with the checkpoint)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key; repeatable",
    )
    parser.add_argument("--float32-verify", action="store_true", help="run the target in float32")
    parser.add_argument(
        "--device", help="device for target and drafter (default: the run's first drafter device)"
    )
    return parser.parse_args(argv)


def load_config(folder: Path, config: str | None, overrides: list[str]):
    """The trainer config: the YAML given, else the one saved with the checkpoint."""
    from dflash.pipeline.checkpointing import saved_config
    from dflash.pipeline.train_config import TrainConfigError, config_from_dict, load_train_config

    if config is not None:
        return load_train_config(config, overrides)
    data = saved_config(folder)
    if data is None:
        raise TrainConfigError(
            f"{folder} holds no saved run config (a bare drafter folder?): pass --config"
        )
    for text in overrides:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            raise TrainConfigError(f"--set {text!r}: expected key=value, e.g. eval.num_prompts=8")
        *parents, leaf = key.strip().split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(raw) if raw.strip() else None
    return config_from_dict(data)


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    from dflash.dflash_workload import EVAL_RESULTS, DFlashWorkload, evaluate_checkpoint
    from dflash.pipeline.train_config import TrainConfigError

    folder = Path(args.checkpoint)
    if not folder.is_dir():
        print(f"error: {folder} is not a directory", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        cfg = load_config(folder, args.config, args.set)
        device = args.device or cfg.runtime.drafter_devices[0]
        cfg.runtime.target_devices = cfg.runtime.drafter_devices = [device]
        if args.float32_verify:
            cfg.target.dtype = "float32"
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        workload = DFlashWorkload(cfg)
        name = "eval-float32.json" if args.float32_verify else EVAL_RESULTS
        result = evaluate_checkpoint(workload, folder, torch.device(device), results_name=name)
    except (TrainConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if result is None:
        print(
            "error: no eval prompts (eval.num_prompts is 0 or no held-out samples)", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    print(result.format_line(), flush=True)
    for div in result.divergences:
        print(json.dumps(div.to_dict()), flush=True)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
