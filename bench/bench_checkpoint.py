"""Checkpoint stall: the synchronous write (before) against the background writer (after).

    python bench/bench_checkpoint.py                      # GPU: the Qwen3-8B drafter; CPU: tiny
    python bench/bench_checkpoint.py --shape qwen3-8b --device cuda:0 --out /data/bench-ckpt
    python bench/bench_checkpoint.py --shape tiny --device cpu

Builds the drafter and its optimizer state at the recipe's shape (the target is not
needed: its embedding and LM head are frozen and never saved): bf16 weights, fp32
masters, AdamW moments, as `trainer/configs/qwen3-8b.yaml` trains them. Then, in one
run, on the same state and disk:

- before: what the trainer did until now, on the training thread: CPU copies of the
  weights and masters, `torch.save` of the state (GPU moments serialised from the
  device), the drafter export, fsync, rename. All of it is stall.
- after, cold: `CheckpointWriter.save_async` for the first time (pinned buffers are
  allocated), then `wait`. Stall is the time save_async blocks the caller.
- after, warm: the same again (buffers reused: the steady state of a run).
- while a warm write is in flight, optimizer steps run on the GPU (fused AdamW over the
  whole state, a memory-bound stand-in for training steps): their time against the same
  steps with no write in flight says what the background write costs the training.
- SIGTERM: a stop arriving just after a periodic checkpoint started: wait for it, then
  write the stop checkpoint (no export), as `run.py` does. Must fit the 20 s grace.

Bytes written and seconds to durable (renamed in place, fsynced) for each. Writes
``<out>/results.json`` (with --out) and prints a table and a JSON line; checkpoints are deleted as it goes (two at
most on disk at once: about 34 GB at the 8B shape).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer"))

from dflash.checkpoint import save_drafter_weights  # noqa: E402
from dflash.config import DrafterConfig  # noqa: E402
from dflash.model import DFlashDrafter  # noqa: E402
from dflash.pipeline import checkpointing as ckpt  # noqa: E402
from dflash.pipeline.optim import MasterWeightAdamW  # noqa: E402
from dflash.pipeline.train_config import OptimSection  # noqa: E402
from dflash.target_presets import PRESETS  # noqa: E402

SHAPES = {
    # Qwen3-8B target shape, 5-layer block-16 drafter: about 1.05B trainable parameters.
    "qwen3-8b": dict(target=PRESETS["qwen3-8b"], layers=5, block=16, mask=151669),
    "tiny": dict(
        target=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        ),
        layers=2,
        block=4,
        mask=511,
    ),
}


def build(shape: str, device: torch.device, dtype: torch.dtype):
    spec = SHAPES[shape]
    cfg = DrafterConfig.from_target_config(
        spec["target"],
        num_layers=spec["layers"],
        block_size=spec["block"],
        mask_token_id=spec["mask"],
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DFlashDrafter(cfg)
    finally:
        torch.set_default_dtype(previous)
    optimizer = MasterWeightAdamW(model.parameters(), OptimSection(), total_steps=1000)
    for _ in range(2):  # the Adam moments exist after the first step
        fake_step(model, optimizer)
    return cfg, model, optimizer


def fake_step(model, optimizer) -> None:
    """Gradients of the right shape and an optimizer step: touches the whole state."""
    for p in optimizer.params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(model, optimizer, device, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        fake_step(model, optimizer)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def collect(step, model, optimizer):
    return ckpt.TrainingState(
        step=step,
        model=ckpt.live_trainable_state(model),
        optimizer=optimizer.state_dict(live=True),
        config={"bench": "checkpoint"},
        rng=ckpt.capture_rng(),
    )


def main(argv=None) -> int:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b" if gpu else "tiny")
    parser.add_argument("--device", default="cuda:0" if gpu else "cpu")
    parser.add_argument("--out", help="folder for the checkpoints (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per timing")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    started = time.perf_counter()
    cfg, model, optimizer = build(args.shape, device, dtype)
    params = sum(p.numel() for p in optimizer.params)
    print(
        f"{args.shape} drafter on {device}: {params / 1e9:.3f}B trainable, {dtype}, "
        f"built in {time.perf_counter() - started:.1f} s",
        flush=True,
    )

    def export(weights, folder):
        save_drafter_weights(weights, cfg, folder, dtype=torch.bfloat16)

    results: dict = {"shape": args.shape, "device": str(device), "trainable_params": params}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)

    # -- before: the synchronous path the trainer used
    synchronize(device)
    start = time.perf_counter()
    state = ckpt.TrainingState(
        step=1,
        model=ckpt.trainable_state(model),
        optimizer=optimizer.state_dict(),
        config={"bench": "checkpoint"},
        rng=ckpt.capture_rng(),
    )
    old_export = lambda f: export(ckpt.live_trainable_state(model), f)  # noqa: E731
    path = ckpt.save_checkpoint(out / "before", state, old_export)
    sync_s = time.perf_counter() - start
    results["before"] = {"stall_s": sync_s, "durable_s": sync_s, "bytes": ckpt.folder_bytes(path)}
    del state
    shutil.rmtree(out / "before")
    print(f"before: stall = durable {sync_s:.2f} s", flush=True)

    # -- after: the background writer, cold then warm
    writer = ckpt.CheckpointWriter(out / "after", lambda line: print(line, flush=True))
    baseline = timed_steps(model, optimizer, device, args.steps)
    for label, step in (("after_cold", 2), ("after_warm", 3)):
        writer.save_async(step, lambda s=step: collect(s, model, optimizer), export)
        during = []
        while writer.busy() and len(during) < 2000:
            during += timed_steps(model, optimizer, device, 1)
        writer.wait()
        stats = writer.stats[-1]
        results[label] = {
            "stall_s": stats.stall_s,
            "durable_s": stats.durable_s,
            "bytes": stats.bytes_written,
            "steps_during_write": len(during),
            "step_ms_during_write": 1e3 * statistics.median(during) if during else None,
        }
        shutil.rmtree(stats.path)
    results["step_ms_no_write"] = 1e3 * statistics.median(baseline)

    # -- SIGTERM right after a periodic checkpoint started
    start = time.perf_counter()
    writer.save_async(4, lambda: collect(4, model, optimizer), export)
    writer.save(5, lambda: collect(5, model, optimizer), None)
    results["sigterm_after_periodic_s"] = time.perf_counter() - start
    shutil.rmtree(out / "after")
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    results["checkpoint_log"] = [s.line() for s in writer.stats]

    gb = results["after_warm"]["bytes"] / 1e9
    print(f"\n| {args.shape} ({params / 1e9:.2f}B, {gb:.1f} GB) | stall | durable after |")
    print("|---|---|---|")
    for label in ("before", "after_cold", "after_warm"):
        r = results[label]
        print(f"| {label} | {r['stall_s']:.2f} s | {r['durable_s']:.1f} s |")
    warm = results["after_warm"]
    if warm["step_ms_during_write"] is not None:
        print(
            f"optimizer step {results['step_ms_no_write']:.1f} ms without a write, "
            f"{warm['step_ms_during_write']:.1f} ms during one ({warm['steps_during_write']} steps)"
        )
    print(
        f"SIGTERM just after a periodic checkpoint: done in {results['sigterm_after_periodic_s']:.1f} s"
    )
    print(json.dumps(results), flush=True)
    if args.out:
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
