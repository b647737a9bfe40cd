"""Trainer throughput: compile modes and schedules, one config, one run, as ratios.

    python bench/bench_trainer.py      # GPU: qwen3-8b.yaml, all modes; CPU: tiny-cpu.yaml, a few
    python bench/bench_trainer.py --config trainer/configs/qwen3-8b.yaml --steps 30 --out /tmp/bench
    python bench/bench_trainer.py --config trainer/configs/tiny-cpu.yaml --variants eager,eager-sequential

Each variant is a separate trainer process (a fresh compile and fresh CUDA graphs), so
one variant cannot leak state into the next. Throughput is the median of the step
lines between the first logging window (filling the queues) and the last (the queue
draining with no target work left): give it at least 4 windows.
Writes ``<out>/<variant>.log``, ``<out>/results.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer"))

from dflash.pipeline.train_config import load_train_config  # noqa: E402

VARIANTS = {
    "eager": ["runtime.compile=eager"],
    "eager-sequential": ["runtime.compile=eager", "runtime.schedule=sequential"],
    "default": ["runtime.compile=default"],
    "reduce-overhead": ["runtime.compile=reduce-overhead"],
    "legacy-cudagraphs": ["runtime.compile=legacy-cudagraphs"],
    "sequential": ["runtime.compile=reduce-overhead", "runtime.schedule=sequential"],
    # The attention the 8B config used before sdpa_chunked: the before/after pair.
    "reduce-overhead-dense": ["runtime.compile=reduce-overhead", "drafter.attention=sdpa_dense"],
    "flex": ["runtime.compile=reduce-overhead", "drafter.attention=flex"],
    "flex-sequential": [
        "runtime.compile=reduce-overhead",
        "drafter.attention=flex",
        "runtime.schedule=sequential",
    ],
}
GPU_DEFAULT = "eager,default,reduce-overhead,legacy-cudagraphs,sequential,reduce-overhead-dense"
CPU_DEFAULT = "eager,eager-sequential,default"
STEP = re.compile(r"^step (\d+)/\d+ \| loss (\S+) .*\| (\d+) tok/s \| mfu (\S+) \|")
READY = re.compile(r"ready \(warm-up ([\d.]+) s")
PEAK = re.compile(r"^peak GPU memory (\S+): ([\d.]+) GiB")


def run_variant(name: str, sets: list[str], args, out: Path) -> dict:
    overrides = [
        f"train.steps={args.steps}",
        f"train.log_every={args.log_every}",
        "eval.enabled=false",
        "train.checkpoint_every=0",
        "train.final_checkpoint=false",
        f"output_dir=/tmp/bench-outputs/{name}",
        *args.set,
        *sets,
    ]
    argv = [
        sys.executable,
        str(ROOT / "trainer" / "train_dflash_pipeline.py"),
        "--config",
        str(args.config),
    ]
    for item in overrides:
        argv += ["--set", item]
    started = time.monotonic()
    log_path = out / f"{name}.log"
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT / "trainer",
                timeout=args.timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.monotonic() - started
    lines = log_path.read_text().splitlines()
    windows = [m for m in map(STEP.match, lines) if m]
    # The first window fills the queues; in the last one the target loops have already
    # produced every batch and the drafter drains the queue alone (on a shared GPU that
    # reads far faster than the steady state). Neither is throughput.
    steady = windows[1:-1] if len(windows) >= 3 else (windows[1:] or windows)
    tok_s = statistics.median(int(m.group(3)) for m in steady) if steady else None
    mfus = [float(m.group(4).rstrip("%")) for m in steady if m.group(4) != "n/a"]
    warm = [float(m.group(1)) for m in map(READY.search, lines) if m]
    peak = {m.group(1): float(m.group(2)) for m in map(PEAK.match, lines) if m}
    return {
        "variant": name,
        "overrides": sets,
        "exit_code": code,
        "wall_s": round(wall, 1),
        "warmup_s": max(warm) if warm else None,
        "tokens_per_s": tok_s,
        "mfu_percent": statistics.median(mfus) if mfus else None,
        "first_loss": float(windows[0].group(2)) if windows else None,
        "last_loss": float(windows[-1].group(2)) if windows else None,
        "peak_gib": peak,
        "graph_lines": [line for line in lines if "CUDA graph" in line or "cudagraph" in line],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config", type=Path, default=None, help="default: by the device, see above"
    )
    parser.add_argument("--variants", default=None, help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--set", action="append", default=[], help="extra override for every variant"
    )
    parser.add_argument("--out", type=Path, default=None, help="default: a new temporary folder")
    args = parser.parse_args()
    import torch

    on_gpu = torch.cuda.is_available()
    if args.config is None:
        args.config = (
            ROOT / "trainer" / "configs" / ("qwen3-8b.yaml" if on_gpu else "tiny-cpu.yaml")
        )
    if args.variants is None:
        args.variants = GPU_DEFAULT if on_gpu else CPU_DEFAULT
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    args.config = args.config.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = load_train_config(args.config, args.set)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * len(cfg.runtime.drafter_devices)

    results = []
    for name in args.variants.split(","):
        result = run_variant(name, VARIANTS[name], args, args.out)
        tok = result["tokens_per_s"]
        result["steps_per_s"] = round(tok / tokens_per_step, 3) if tok else None
        results.append(result)
        print(f"{name}: exit {result['exit_code']}, {result['wall_s']} s, {tok} tok/s", flush=True)
        (args.out / "results.json").write_text(
            json.dumps(results, indent=2) + "\n"
        )  # partial runs count

    base = next((r for r in results if r["variant"] == "eager" and r["tokens_per_s"]), None)
    print(f"\nlogs and results.json under {args.out}")
    print(
        f"config {args.config.name}: {tokens_per_step} tokens/step, {args.steps} steps per variant"
    )
    print(
        f"{'variant':<22} {'exit':>4} {'warm-up s':>9} {'steps/s':>8} {'tok/s':>9} {'mfu':>7} "
        f"{'peak GiB':>8} {'vs eager':>8}"
    )
    for r in results:
        ratio = (r["tokens_per_s"] / base["tokens_per_s"]) if base and r["tokens_per_s"] else None
        r["ratio_vs_eager"] = round(ratio, 3) if ratio else None
        peak = max(r["peak_gib"].values()) if r["peak_gib"] else None
        print(
            f"{r['variant']:<22} {r['exit_code']!s:>4} {_fmt(r['warmup_s'], 9, 1)} {_fmt(r['steps_per_s'], 8, 3)} "
            f"{_fmt(r['tokens_per_s'], 9, 0)} {_fmt(r['mfu_percent'], 6, 1)}% {_fmt(peak, 8, 1)} "
            f"{_fmt(ratio, 8, 2)}"
        )
    pairs = (
        ("reduce-overhead", "sequential"),
        ("flex", "flex-sequential"),
        ("eager", "eager-sequential"),
    )
    for piped_name, seq_name in pairs:
        piped = next((r for r in results if r["variant"] == piped_name), None)
        seq = next((r for r in results if r["variant"] == seq_name), None)
        if piped and seq and piped["tokens_per_s"] and seq["tokens_per_s"]:
            ratio = piped["tokens_per_s"] / seq["tokens_per_s"]
            print(f"pipelined / sequential ({piped_name}): {ratio:.3f}")
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


def _fmt(value, width: int, digits: int) -> str:
    return f"{value:>{width}.{digits}f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


if __name__ == "__main__":
    raise SystemExit(main())
