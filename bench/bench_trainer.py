"""Trainer throughput with every measurement on, and what each measurement costs.

    python bench/bench_trainer.py      # GPU: qwen3-8b.yaml, reduce-overhead; CPU: tiny-cpu.yaml, eager
    python bench/bench_trainer.py --config trainer/configs/qwen3-8b.yaml --steps 30 --out /tmp/bench
    python bench/bench_trainer.py --variants eager,eager-sequential   # compare compile modes instead
    python bench/bench_trainer.py --extra target-eager,fp8                # more variants beside the costs
    python bench/bench_trainer.py --measurements "" --steps 600 --rounds 5  # CPU: defaults vs all off

By default it runs the shipped defaults (the tau~ serving walk and its budget, the stack
watcher, TensorBoard beside metrics.jsonl, the NCCL flight recorder's variables as
dflashctl sets them, and a mid-run eval with --eval-every), the same with all of them
off, and one variant per measurement with only that one off, and prints each one's
tokens/s and its ratio to all-off (the cost of the measurement beside the headline).
Each variant is a separate trainer process (a fresh compile and fresh CUDA graphs), so
one variant cannot leak state into the next. Throughput counts every second between the
end of the first logging window (filling the queues) and the end of the last but one
(the last drains the queue with no target work left), walks and evals included, from
metrics.jsonl; give it at least 4 windows.
Writes ``<out>/<variant>.log``, ``<out>/results.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
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
VARIANTS.update(
    {
        # the target forward: the default is written out (target.fused) and compiled
        # (target.compile: auto); these are the others
        "target-eager": ["target.fused=false", "target.compile=false"],  # before 2026-12-05
        "fused-eager": ["target.compile=false"],
        "target-compiled": ["target.fused=false", "target.compile=true"],
        "fp8": ["target.fp8=true"],
        "fp8-eager": ["target.fp8=true", "target.compile=false"],
    }
)
# Each measurement the trainer makes while it trains, and how to switch it off:
# (overrides, environment).
MEASUREMENTS = {
    "walk": (["train.tau_walk_rows=0"], {}),
    "eval": (["eval.every=0"], {}),
    "trackers": (["logging.tensorboard=false"], {}),
    "stacks": ([], {"DFLASH_STACK_WATCH": "0"}),
    "flight-recorder": ([], {"TORCH_NCCL_TRACE_BUFFER_SIZE": None}),
}
# What dflashctl's launch sets (dflashctl/agent/runs.py: flight_recorder_env).
FLIGHT_RECORDER_ENV = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_FR_BUFFER_SIZE": "2000",
}
MEASUREMENTS["flight-recorder"] = ([], {name: None for name in FLIGHT_RECORDER_ENV})
STEP = re.compile(r"^step (\d+)/\d+ \| loss (\S+) .*\| (\d+) tok/s \| mfu (\S+) \|")
READY = re.compile(r"ready \(warm-up ([\d.]+) s")
TARGET_READY = re.compile(r"target ready \(compile ([\d.]+) s")
PEAK = re.compile(r"^peak GPU memory (\S+): ([\d.]+) GiB")
WALK = re.compile(
    r"^tau walk \| step \d+ \| tau \S+ \(tau~ \S+\) \| ([\d.]+) s \| (\d+) walks, ([\d.]+)%"
)
EVAL = re.compile(r"^eval at step \d+ \|.*\| ([\d.]+) s of training time")


def measurements_on(args) -> tuple[list[str], dict[str, str]]:
    """The shipped defaults' measurements, all on, as overrides and environment."""
    sets = []
    if args.eval_every:
        sets += ["eval.enabled=true", f"eval.every={args.eval_every}"]
    if _tensorboard_installed():
        sets.append("logging.tensorboard=true")
    return sets, dict(FLIGHT_RECORDER_ENV)


def _tensorboard_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def run_variant(
    name: str, sets: list[str], args, out: Path, env: dict | None = None, log_name: str = ""
) -> dict:
    output_dir = Path(f"/tmp/bench-outputs/{name}")
    shutil.rmtree(output_dir, ignore_errors=True)  # metrics.jsonl is appended to
    overrides = [
        f"train.steps={args.steps}",
        f"train.log_every={args.log_every}",
        "eval.enabled=false",
        "train.checkpoint_every=0",
        "train.final_checkpoint=false",
        f"output_dir={output_dir}",
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
    environment = {k: v for k, v in os.environ.items() if k != "DFLASH_RUN_DIR"}
    for key, value in (env or {}).items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = value
    started = time.monotonic()
    used_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    log_path = out / f"{log_name or name}.log"
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT / "trainer",
                timeout=args.timeout,
                env=environment,
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.monotonic() - started
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    # The trainer's CPU seconds (start-up included, the same in every variant): the work a
    # measurement adds, which the clock on a 2-core machine cannot resolve from scheduling.
    cpu_s = (used.ru_utime - used_before.ru_utime) + (used.ru_stime - used_before.ru_stime)
    lines = log_path.read_text().splitlines()
    windows = [m for m in map(STEP.match, lines) if m]
    records = _step_records(output_dir / "metrics.jsonl")
    tok_s, mfu = _throughput(records)
    if tok_s is None:  # no metrics.jsonl: the step lines' median
        steady = windows[1:-1] if len(windows) >= 3 else (windows[1:] or windows)
        tok_s = statistics.median(int(m.group(3)) for m in steady) if steady else None
    warm = [float(m.group(1)) for m in map(READY.search, lines) if m]
    target_warm = [float(m.group(1)) for m in map(TARGET_READY.search, lines) if m]
    peak = {m.group(1): float(m.group(2)) for m in map(PEAK.match, lines) if m}
    walks = [m for m in map(WALK.match, lines) if m]
    evals = [float(m.group(1)) for m in map(EVAL.match, lines) if m]
    taus = [(r.get("tau"), r.get("tau_walk")) for r in records]
    return {
        "variant": name,
        "overrides": sets,
        "env": env or {},
        "exit_code": code,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu_s, 2),
        "warmup_s": max(warm) if warm else None,
        "target_compile_s": max(target_warm) if target_warm else None,
        "tokens_per_s": round(tok_s, 1) if tok_s else None,
        "mfu_percent": mfu,
        "first_loss": float(windows[0].group(2)) if windows else None,
        "last_loss": float(windows[-1].group(2)) if windows else None,
        "peak_gib": peak,
        "windows": len(records),
        "walks": len(walks),
        "walk_s": [float(m.group(1)) for m in walks],
        "walk_share_percent": float(walks[-1].group(3)) if walks else None,
        "evals_s": evals,
        "tau_and_walk": taus,
        "graph_lines": [line for line in lines if "CUDA graph" in line or "cudagraph" in line],
    }


def _median_round(runs: list[dict]) -> dict:
    """One variant's rounds as one result: the round with the median tokens/s (its
    other fields stay that round's), every round's tokens/s beside it."""
    done = sorted((r for r in runs if r["tokens_per_s"]), key=lambda r: r["tokens_per_s"])
    chosen = dict(done[(len(done) - 1) // 2] if done else runs[-1])
    if len(done) % 2 == 0 and done:  # an even count: the mean of the middle two
        middle = done[len(done) // 2 - 1 : len(done) // 2 + 1]
        chosen["tokens_per_s"] = round(sum(r["tokens_per_s"] for r in middle) / 2, 1)
        chosen["steps_per_s"] = round(sum(r["steps_per_s"] for r in middle) / 2, 3)
    chosen["rounds_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    chosen["cpu_s"] = round(statistics.median(r["cpu_s"] for r in runs), 2)
    return chosen


def _step_records(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "step":
            records.append(record)
    return records


def _throughput(records: list[dict]) -> tuple[float | None, float | None]:
    """Tokens per second and MFU (%) over the second half of the run (to the end of the
    last window but one), every second counted (walks, evals, a profiler trace).

    Not from the first window on: the first walk runs in the first window, while the
    target threads go on filling the queue, and the drafter then drains that queue faster
    than steady state; a window that starts after the stall but takes in the drain read
    17% over the steady state on an H100. The second half holds both or neither."""
    if len(records) < 3:
        return None, None
    start = min(max(0, len(records) // 2 - 1), len(records) - 3)
    first, last = records[start], records[-2]
    seconds = last["elapsed_s"] - first["elapsed_s"]
    if seconds <= 0:
        return None, None
    steps = last["step"] - first["step"]
    per_step = records[1]["tokens_per_s"] / max(1e-9, records[1]["steps_per_s"])
    tok_s = steps * per_step / seconds
    mfus = [r["mfu"] / r["steps_per_s"] for r in records[1:-1] if r.get("mfu")]
    mfu = round(100 * statistics.median(mfus) * steps / seconds, 1) if mfus else None
    return tok_s, mfu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config", type=Path, default=None, help="default: by the device, see above"
    )
    parser.add_argument(
        "--variants",
        default=None,
        help=f"compare these instead of the measurement costs: comma list of {', '.join(VARIANTS)}",
    )
    parser.add_argument(
        "--mode", default=None, help="the variant the costs are measured on (default by device)"
    )
    parser.add_argument(
        "--measurements",
        default=",".join(MEASUREMENTS),
        help="which measurements get a variant with only them off (comma list; empty: none)",
    )
    parser.add_argument("--extra", default="", help="more variants beside the costs (comma list)")
    parser.add_argument(
        "--eval-every", type=int, default=0, help="a mid-run eval every N steps (0: none)"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--set", action="append", default=[], help="extra override for every variant"
    )
    parser.add_argument("--out", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every variant this many times, interleaved, and take the median "
        "(a busy or 2-core machine moves single runs by 20-30%%)",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    import torch

    on_gpu = torch.cuda.is_available()
    if args.config is None:
        args.config = (
            ROOT / "trainer" / "configs" / ("qwen3-8b.yaml" if on_gpu else "tiny-cpu.yaml")
        )
    if args.mode is None:
        args.mode = "reduce-overhead" if on_gpu else "eager"
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    args.config = args.config.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = load_train_config(args.config, args.set)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * len(cfg.runtime.drafter_devices)

    on_sets, on_env = measurements_on(args)
    plan: list[tuple[str, list[str], dict]] = []  # (name, overrides, environment)
    if args.variants:
        plan = [(n, VARIANTS[n] + on_sets, on_env) for n in args.variants.split(",")]
    else:
        base = VARIANTS[args.mode]
        chosen = [m for m in args.measurements.split(",") if m]
        if "eval" in chosen and not args.eval_every:
            chosen.remove("eval")  # no mid-run eval to switch off
        off_sets = [o for m in MEASUREMENTS for o in MEASUREMENTS[m][0]]
        off_env = {k: v for m in MEASUREMENTS for k, v in MEASUREMENTS[m][1].items()}
        plan.append(("defaults", base + on_sets, on_env))
        plan.append(("all-off", base + on_sets + off_sets, {**on_env, **off_env}))
        for m in chosen:
            plan.append(
                (f"no-{m}", base + on_sets + MEASUREMENTS[m][0], {**on_env, **MEASUREMENTS[m][1]})
            )
    for name in [e for e in args.extra.split(",") if e]:
        plan.append((name, VARIANTS[args.mode] + on_sets + VARIANTS[name], on_env))

    rounds: dict[str, list[dict]] = {name: [] for name, _, _ in plan}
    for round_no in range(1, args.rounds + 1):
        for name, sets, env in plan:
            log_name = name if args.rounds == 1 else f"{name}-round{round_no}"
            result = run_variant(name, sets, args, args.out, env, log_name)
            tok = result["tokens_per_s"]
            result["steps_per_s"] = round(tok / tokens_per_step, 3) if tok else None
            rounds[name].append(result)
            tag = "" if args.rounds == 1 else f" (round {round_no})"
            print(
                f"{name}{tag}: exit {result['exit_code']}, {result['wall_s']} s, {tok} tok/s",
                flush=True,
            )
            if result["exit_code"] == "timeout" and result["first_loss"] is None:
                compile_s = result["target_compile_s"]
                took = f"; its target compile took {compile_s} s" if compile_s else ""
                print(
                    f"  {name} passed --timeout {args.timeout:.0f} s before its first step: "
                    f"raise --timeout (the first variant to run also compiles cold{took})",
                    flush=True,
                )
            partial = [r for runs in rounds.values() for r in runs]
            (args.out / "results.json").write_text(json.dumps(partial, indent=2) + "\n")
    results = [_median_round(runs) for runs in rounds.values() if runs]

    reference = "eager" if args.variants else "all-off"
    base = next((r for r in results if r["variant"] == reference and r["tokens_per_s"]), None)
    print(f"\nlogs and results.json under {args.out}")
    print(
        f"config {args.config.name}: {tokens_per_step} tokens/step, {args.steps} steps per "
        f"variant, measurements on: {' '.join(on_sets) or '(config as is)'} + flight recorder env"
    )
    print(
        f"{'variant':<18} {'exit':>4} {'warm-up s':>9} {'steps/s':>8} {'tok/s':>9} {'mfu':>7} "
        f"{'peak GiB':>8} {'vs ' + reference:>10} {'walks':>5}"
    )
    for r in results:
        ratio = (r["tokens_per_s"] / base["tokens_per_s"]) if base and r["tokens_per_s"] else None
        r[f"ratio_vs_{reference}"] = round(ratio, 4) if ratio else None
        peak = max(r["peak_gib"].values()) if r["peak_gib"] else None
        print(
            f"{r['variant']:<18} {r['exit_code']!s:>4} {_fmt(r['warmup_s'], 9, 1)} "
            f"{_fmt(r['steps_per_s'], 8, 3)} {_fmt(r['tokens_per_s'], 9, 0)} "
            f"{_fmt(r['mfu_percent'], 6, 1)}% {_fmt(peak, 8, 1)} {_fmt(ratio, 10, 3)} "
            f"{r['walks']:>5}"
        )
    defaults = next((r for r in results if r["variant"] == "defaults" and r["tokens_per_s"]), None)
    for r in results:
        if r["tokens_per_s"] and r.get("windows", 4) < 4:
            # Three windows leave only the second, which drains the queue the target
            # filled during the first (and during its walk) and reads over steady state.
            print(
                f"warning: {r['variant']} logged {r['windows']} windows (exit {r['exit_code']}): "
                "its rate is the second window alone, which drains the queue and reads over "
                "steady state; raise "
                "--timeout or --steps for a figure"
            )
    if defaults and base:
        print(
            f"defaults on / all off: {defaults['tokens_per_s'] / base['tokens_per_s']:.3f} "
            f"(mfu {_fmt(defaults['mfu_percent'], 0, 1)}% vs {_fmt(base['mfu_percent'], 0, 1)}%)"
            + (f", medians of {args.rounds} rounds" if args.rounds > 1 else "")
        )
        if args.rounds > 1:
            each = [
                d["tokens_per_s"] / a["tokens_per_s"]
                for d, a in zip(rounds["defaults"], rounds["all-off"], strict=False)
                if d["tokens_per_s"] and a["tokens_per_s"]
            ]
            print(f"  each round: {', '.join(f'{x:.3f}' for x in each)}")
        if not defaults["mfu_percent"]:  # CPU: the work each one adds, less moved by scheduling
            print(
                f"  trainer CPU seconds (start-up included): defaults {defaults['cpu_s']:.1f}, "
                f"all off {base['cpu_s']:.1f} ({defaults['cpu_s'] / base['cpu_s']:.3f}x)"
            )
        for r in results:
            if r["variant"].startswith("no-") and r["tokens_per_s"]:
                cost = 1 - defaults["tokens_per_s"] / r["tokens_per_s"]
                print(f"  cost of {r['variant'][3:]:<16} {100 * cost:+.1f}% (defaults vs it off)")
        if defaults["walks"]:
            print(
                f"  tau walks in the defaults run: {defaults['walks']} "
                f"({', '.join(f'{x:.2f}' for x in defaults['walk_s'])} s), "
                f"{defaults['walk_share_percent']}% of its training time"
            )
        if defaults["evals_s"]:
            print(f"  mid-run evals: {', '.join(f'{x:.1f}' for x in defaults['evals_s'])} s each")
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
