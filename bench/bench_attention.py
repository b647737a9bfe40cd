"""Drafter attention backends: one drafter step (forward + backward), eager, as ratios.

    python bench/bench_attention.py                       # GPU: qwen3-8b.yaml; CPU: tiny-cpu.yaml
    python bench/bench_attention.py --config trainer/configs/qwen3-8b.yaml --iters 10

Baseline, in the same run: "sdpa_dense" (one SDPA over every context key with a dense
mask). Candidates: "sdpa_chunked" at several chunk sizes (the same visible keys per
row, computed only over the context a chunk of anchors can reach). Every backend runs
the production loss module on the production shapes (the trainer's own
`example_inputs`), and must give the dense loss and gradient norm back. Also times
the target forward on the same batch, for where a training step's time goes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer"))

import torch  # noqa: E402
from dflash.dflash_workload import DFlashWorkload  # noqa: E402
from dflash.pipeline.train_config import load_train_config  # noqa: E402
from dflash.pipeline.workload import Batch  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--chunks", default="16,32,64", help="anchors per chunk to try")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], help="config override")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    config = args.config or ROOT / "trainer" / "configs" / (
        "qwen3-8b.yaml" if on_gpu else "tiny-cpu.yaml"
    )
    cfg = load_train_config(config, args.set)
    workload = DFlashWorkload(cfg)
    device = torch.device(cfg.runtime.drafter_devices[0])
    drafter = workload.build_drafter(device)
    module = workload.loss_module(drafter)
    x = workload.example_inputs(device)
    n, s = x.input_ids.shape
    print(
        f"config {config.name}: batch {n} x {s} tokens, {x.anchors.shape[1]} anchors x "
        f"block {workload.drafter_cfg.block_size}, drafter "
        f"{drafter.num_trainable_parameters() / 1e9:.2f}B, {device}, torch {torch.__version__}"
    )

    def step():
        drafter.zero_grad(set_to_none=True)
        loss, _ = module(*x.tensors())
        loss.backward()
        return loss

    rows = []
    backends = [("sdpa_dense", 0)] + [("sdpa_chunked", int(c)) for c in args.chunks.split(",")]
    for name, chunk in backends:
        module.attention, module.attention_chunk = name, chunk or module.attention_chunk
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        loss = step()
        grad_norm = torch.linalg.vector_norm(
            torch.stack([p.grad.float().norm() for p in drafter.parameters() if p.grad is not None])
        )
        times = time_ms(step, device, args.warmup, args.iters)
        peak = (
            (torch.cuda.max_memory_allocated(device) - base) / 2**30
            if device.type == "cuda"
            else None
        )
        label = name if not chunk else f"{name} ({chunk} anchors/chunk)"
        rows.append((label, statistics.median(times), peak, loss.item(), grad_norm.item()))
        print(f"  {label}: {statistics.median(times):.1f} ms", flush=True)

    target = workload.target_for(torch.device(cfg.runtime.target_devices[0]))
    batch = Batch(
        step=0,
        shard=0,
        input_ids=x.input_ids,
        attention_mask=torch.ones_like(x.input_ids),
        loss_mask=x.loss_mask.long(),
        anchors=x.anchors,
        anchor_valid=x.anchor_valid,
    )
    target_ms = statistics.median(
        time_ms(lambda: workload.target_context(target, batch), device, 1, max(3, args.iters // 2))
    )

    dense = rows[0]
    print(
        f"\n{'backend':<36} {'fwd+bwd ms':>10} {'vs dense':>8} {'peak GiB':>8} {'loss':>9} {'grad norm':>10}"
    )
    for label, ms, peak, loss, gnorm in rows:
        peak_s = f"{peak:8.2f}" if peak is not None else f"{'-':>8}"
        print(f"{label:<36} {ms:10.1f} {dense[1] / ms:7.2f}x {peak_s} {loss:9.5f} {gnorm:10.4f}")
    print(f"target forward on the same batch: {target_ms:.1f} ms")
    worst = max(abs(r[3] - dense[3]) / max(abs(dense[3]), 1e-6) for r in rows)
    print(f"largest relative loss difference vs dense: {worst:.2e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
