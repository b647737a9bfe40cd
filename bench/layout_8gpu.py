"""Predicted tokens/s of 8-GPU layouts from measured per-part times.

    python bench/layout_8gpu.py                          # the issue's H200 numbers (torch 2.11)
    python bench/layout_8gpu.py --results /tmp/dist/results.json   # numbers of a bench_dist run
    python bench/layout_8gpu.py --allreduce2-ms 6.2      # e.g. bf16 gradients

Inputs (milliseconds per batch of one drafter, i.e. one 8192-token sequence of qwen3-8b):
  pair      one GPU running the target forward and the drafter step (1 / steps/s)
  target    the target forward alone on its GPU (the split layout's target-bound rate)
  drafter   the drafter step alone on its GPU (forward, backward, optimizer)
  allreduce averaging the drafter's 1.05B gradients between 2 GPUs (NCCL)

Model: a ring all-reduce moves 2(n-1)/n of the buffer per GPU, so with NVSwitch
bandwidth per GPU constant its time grows from the 2-GPU figure by (n-1)/n / (1/2):
1.75x at 8. With R replicas (target + drafter on every GPU) a step takes
pair + allreduce(R). With T target GPUs feeding D drafter GPUs, the drafters step
together (they average every step), so the slower side sets the pace:
D / max(target x batches each target owes per step, drafter + allreduce(D)). The trainer
feeds drafter j from target j % T, so targets beyond D have no drafter ("as built");
the last column assumes batches routed to any free target (not built).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

GPUS = 8
# Measured on 2 x H200, torch 2.11, qwen3-8b.yaml, random weights (issue 16).
ISSUE = {
    "tokens_per_batch": 8192,
    "pair_ms": 1000 / 2.263,  # 18,540 tokens/s, 47.6% MFU
    "target_ms": 8192
    / 30450
    * 1000,  # target cuda:0 + drafter cuda:1: 30,450 tokens/s, target-bound
    "drafter_ms": None,  # not measured alone there: pair - target (see below)
    "allreduce2_ms": 12.4,  # torch.cuda.nccl.all_reduce of 1.05B fp32 gradients (bf16: 6.2)
    "pair_mfu": 47.6,
}


def ring_factor(n: int) -> float:
    """All-reduce time at n GPUs relative to 2 GPUs."""
    return 0.0 if n < 2 else (2 * (n - 1) / n) / 1.0


def from_results(path: Path, inputs: dict) -> dict:
    """Per-part times from bench_dist.py's results.json (what it measured wins)."""
    by = {r["case"]: r for r in json.loads(path.read_text())}
    one = by.get("one-gpu") or {}
    if one.get("tokens_per_s"):
        inputs["pair_ms"] = inputs["tokens_per_batch"] / one["tokens_per_s"] * 1000
        if one.get("mfu_percent"):
            inputs["pair_mfu"] = one["mfu_percent"]
    split = (by.get("split") or {}).get("parts_ms", {})
    if split.get("target forward"):
        inputs["target_ms"] = split["target forward"]
    if split.get("drafter step"):
        inputs["drafter_ms"] = split["drafter step"]
    for case in ("torchrun-2", "threads-2"):
        averaging = (by.get(case) or {}).get("parts_ms", {}).get("grad averaging")
        if averaging:
            inputs["allreduce2_ms"] = averaging
            inputs["allreduce_from"] = case
            break
    two = by.get("torchrun-2") or {}
    if two.get("tokens_per_s") and one.get("tokens_per_s"):
        inputs["scaling2"] = two["tokens_per_s"] / (2 * one["tokens_per_s"])
    return inputs


def layouts(inputs: dict) -> list[dict]:
    tpb, pair, target = inputs["tokens_per_batch"], inputs["pair_ms"], inputs["target_ms"]
    drafter = inputs["drafter_ms"] or max(1.0, pair - target)
    ar2 = inputs["allreduce2_ms"]
    rows = []
    step = pair + ar2 * ring_factor(GPUS)
    rows.append(
        {
            "layout": f"{GPUS} replicas (target + drafter on every GPU)",
            "targets": GPUS,
            "drafters": GPUS,
            "as_built": GPUS * tpb / step * 1000,
            "routed": GPUS * tpb / step * 1000,
            "bound": f"step {step:.0f} ms (all-reduce {ar2 * ring_factor(GPUS):.1f} ms)",
        }
    )
    for t in range(1, GPUS):
        d = GPUS - t
        drafter_step = drafter + ar2 * ring_factor(d)
        fed = min(t, d)  # targets that own a drafter (drafter j <- target j % T)
        owed = math.ceil(d / fed)  # batches the busiest target makes per step
        as_built = d * tpb / max(target * owed, drafter_step) * 1000
        routed = tpb * min(t / target, d / drafter_step) * 1000
        bound = "target-bound" if target * owed > drafter_step else "drafter-bound"
        rows.append(
            {
                "layout": f"{t} target GPUs + {d} drafter GPUs",
                "targets": t,
                "drafters": d,
                "as_built": as_built,
                "routed": routed,
                "bound": f"{bound}: target {target:.0f} ms x {owed}, drafter {drafter_step:.0f} ms",
            }
        )
    for row in rows:
        row["mfu"] = inputs["pair_mfu"] * row["as_built"] / (GPUS * tpb / pair * 1000)
    return rows


def config_for(row: dict) -> str:
    t, d = row["targets"], row["drafters"]
    if row["layout"].startswith(f"{GPUS} replicas"):
        return (
            f"torchrun --standalone --nproc-per-node {GPUS} train_dflash_pipeline.py "
            "--config configs/qwen3-8b.yaml   # each rank: target + drafter on its own GPU"
        )
    if t == d:
        return (
            f"torchrun --standalone --nproc-per-node {d} train_dflash_pipeline.py --config "
            "configs/qwen3-8b.yaml --set runtime.target_devices=[cuda:0] --set "
            "runtime.drafter_devices=[cuda:1]   # rank r: target on GPU 2r, drafter on 2r+1"
        )
    targets = ",".join(f"cuda:{i}" for i in range(t))
    drafters = ",".join(f"cuda:{i}" for i in range(t, GPUS))
    return (
        "python train_dflash_pipeline.py --config configs/qwen3-8b.yaml --set "
        f"runtime.target_devices=[{targets}] --set runtime.drafter_devices=[{drafters}]"
        "   # one process, drafter threads averaging over in-process NCCL"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, help="results.json of bench/bench_dist.py")
    parser.add_argument("--pair-ms", type=float)
    parser.add_argument("--target-ms", type=float)
    parser.add_argument("--drafter-ms", type=float)
    parser.add_argument("--allreduce2-ms", type=float)
    parser.add_argument("--tokens-per-batch", type=int)
    args = parser.parse_args()
    inputs = dict(ISSUE)
    inputs["allreduce_from"] = "issue 16 (torch.cuda.nccl, fp32)"
    if args.results:
        inputs = from_results(args.results, inputs)
    for key in ("pair_ms", "target_ms", "drafter_ms", "allreduce2_ms", "tokens_per_batch"):
        value = getattr(args, key)
        if value is not None:
            inputs[key] = value
    drafter_note = "" if inputs["drafter_ms"] else " (not measured alone: pair - target)"
    drafter = inputs["drafter_ms"] or max(1.0, inputs["pair_ms"] - inputs["target_ms"])
    print(
        f"inputs: pair {inputs['pair_ms']:.1f} ms, target {inputs['target_ms']:.1f} ms, "
        f"drafter {drafter:.1f} ms{drafter_note}, all-reduce at 2 GPUs "
        f"{inputs['allreduce2_ms']:.1f} ms ({inputs['allreduce_from']}), "
        f"{inputs['tokens_per_batch']} tokens per batch"
        + (
            f", measured 2-GPU scaling {100 * inputs['scaling2']:.1f}%"
            if "scaling2" in inputs
            else ""
        )
    )
    rows = layouts(inputs)
    print()
    print(
        "| layout | tokens/s (as built) | MFU | tokens/s (batches routed to any target) | what bounds it |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['layout']} | {row['as_built']:,.0f} | {row['mfu']:.1f}% | "
            f"{row['routed']:,.0f} | {row['bound']} |"
        )
    best = max(rows, key=lambda r: r["as_built"])
    print(f"\nbest as built: {best['layout']}, {best['as_built']:,.0f} tokens/s")
    print(f"config: {config_for(best)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
