"""Rank 0 sends a resume state to ranks that cannot read its checkpoint: time, memory, exactness.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        bench/bench_resume_broadcast.py --out /tmp/resume-broadcast            # GPUs: NCCL, Qwen3-8B drafter
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        bench/bench_resume_broadcast.py --shape tiny --out /tmp/resume-broadcast  # CPU: gloo

The state has the Qwen3-8B drafter's tensors (5 layers, hidden 4096, FFN 12288: 1.05B
trainable parameters) as a checkpoint holds them: bf16 weights, fp32 masters and both
Adam moments (~14.7 GB), made from a seed on rank 0. ``state_broadcast.broadcast_state``
(the trainer's own) sends it; every other rank then rebuilds each tensor from the seed
and compares it bit for bit. Reports seconds, GB/s, and each rank's peak host memory
growth (RSS) and peak GPU memory during the transfer: the claim is "flat", i.e. a
receiver grows by about the state's size (it keeps the state, as a local load would)
and the GPU holds one tensor at a time. Writes ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer"))

from dflash.pipeline import checkpointing as ckpt  # noqa: E402
from dflash.pipeline.state_broadcast import broadcast_state  # noqa: E402

SHAPES = {  # layers, hidden, ffn, kv width, context layers
    "qwen3-8b": (5, 4096, 12288, 1024, 5),
    "tiny": (2, 64, 192, 32, 2),
}


def parameter_shapes(shape: str) -> dict[str, tuple[int, ...]]:
    layers, hidden, ffn, kv, context = SHAPES[shape]
    shapes = {"fc.weight": (hidden, context * hidden), "hidden_norm.weight": (hidden,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "q_proj.weight": (hidden, hidden),
            p + "k_proj.weight": (kv, hidden),
            p + "v_proj.weight": (kv, hidden),
            p + "o_proj.weight": (hidden, hidden),
            p + "gate_proj.weight": (ffn, hidden),
            p + "up_proj.weight": (ffn, hidden),
            p + "down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,),
        }
    return shapes


def made(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def planned(shape: str) -> list[tuple[str, int, tuple[int, ...], torch.dtype]]:
    """(kind, seed, shape, dtype) per tensor, in the state's order."""
    rows = []
    for seed, (_, dims) in enumerate(parameter_shapes(shape).items()):
        rows.append(("weight", seed, dims, torch.bfloat16))
        rows.append(("master", 10_000 + seed, dims, torch.float32))
        rows.append(("exp_avg", 20_000 + seed, dims, torch.float32))
        rows.append(("exp_avg_sq", 30_000 + seed, dims, torch.float32))
    return rows


def build_state(shape: str) -> ckpt.TrainingState:
    names = list(parameter_shapes(shape))
    tensors = {(kind, seed): made(seed, dims, dt) for kind, seed, dims, dt in planned(shape)}
    model = {name: tensors["weight", i] for i, name in enumerate(names)}
    moments = {
        i: {
            "step": torch.tensor(120.0),
            "exp_avg": tensors["exp_avg", 20_000 + i],
            "exp_avg_sq": tensors["exp_avg_sq", 30_000 + i],
        }
        for i in range(len(names))
    }
    optimizer = {
        "optimizer": {"state": moments, "param_groups": [{"lr": 6e-4, "params": list(moments)}]},
        "scheduler": {"last_step": 120},
        "masters": [tensors["master", 10_000 + i] for i in range(len(names))],
    }
    return ckpt.TrainingState(
        step=120, model=model, optimizer=optimizer, config={"shape": shape}, rng=ckpt.capture_rng()
    )


def state_bytes(shape: str) -> int:
    total = 0
    for _, _, dims, dtype in planned(shape):
        count = 1
        for d in dims:
            count *= d
        total += count * torch.empty((), dtype=dtype).element_size()
    return total


def check(state: ckpt.TrainingState, shape: str) -> int:
    """Every received tensor equals the one rank 0 made from the same seed; the count."""
    names = list(parameter_shapes(shape))
    checked = 0
    for kind, seed, dims, dtype in planned(shape):
        i = seed % 10_000
        moments = state.optimizer["optimizer"]["state"][i]
        got = {
            "weight": state.model[names[i]],
            "master": state.optimizer["masters"][i],
            "exp_avg": moments["exp_avg"],
            "exp_avg_sq": moments["exp_avg_sq"],
        }[kind]
        expected = made(seed, dims, dtype)
        if got.dtype != dtype or not torch.equal(got.view(torch.uint8), expected.view(torch.uint8)):
            raise SystemExit(f"{kind} {names[i]}: received tensor differs from rank 0's")
        checked += 1
    return checked


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None)
    parser.add_argument("--out", default="bench-resume-broadcast")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    shape = args.shape or ("qwen3-8b" if on_gpu else "tiny")
    rank = int(os.environ["RANK"])
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")

    state = build_state(shape) if rank == 0 else None
    dist.barrier()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_before = rss_bytes()
    started = time.perf_counter()
    received = broadcast_state(state, device)
    seconds = time.perf_counter() - started
    row = {
        "rank": rank,
        "seconds": seconds,
        "rss_growth_bytes": rss_bytes() - rss_before,
        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if on_gpu else 0,
        "checked_tensors": check(received, shape) if rank != 0 else 0,
    }
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        size = state_bytes(shape)
        largest = max(
            torch.empty(dims, dtype=dtype, device="meta").nbytes
            for _, _, dims, dtype in planned(shape)
        )
        results = {
            "shape": shape,
            "backend": dist.get_backend(),
            "state_bytes": size,
            "largest_tensor_bytes": largest,
            "ranks": rows,
            "gb_per_s": size / 1e9 / max(r["seconds"] for r in rows),
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        print(
            f"{shape} state {size / 1e9:.2f} GB over {results['backend']}: "
            f"{results['gb_per_s']:.2f} GB/s; largest tensor {largest / 1e6:.1f} MB"
        )
        for r in rows:
            print(
                f"rank {r['rank']}: {r['seconds']:.2f} s | RSS +{r['rss_growth_bytes'] / 1e9:.2f} "
                f"GB | GPU peak {r['gpu_peak_bytes'] / 1e6:.1f} MB | "
                f"{r['checked_tensors']} tensors bit-identical"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
