"""Crash-rule matching throughput on a 1M-line training log with realistic noise.

The log follower feeds every line of a run's log through CrashDetector, so the detector
must keep up with a chatty trainer: target 200,000 lines/s on the development machine.

Baseline, measured in the same run on the same lines: the naive detector that tries
every rule regex (plus the traceback-shape regexes) on every line. Both must find the
crashes planted in the log; the script checks that too.

    .venv/bin/python bench/bench_crash_matching.py [--lines 1000000] [--baseline-lines 200000]
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflashctl.crash import CrashDetector, load_rules  # noqa: E402
from dflashctl.crash.detector import (  # noqa: E402
    _ANNOUNCE_FAILED,
    _ANNOUNCE_THREAD,
    _EXCEPTION,
    _FRAME,
    _STAGE,
)

TARGET_LINES_PER_S = 200_000
SP = "/usr/local/lib/python3.11/site-packages"

WARNINGS = [
    f"{SP}/torch/_inductor/compile_fx.py:236: UserWarning: TensorFloat32 tensor cores for "
    "float32 matrix multiplication available but not enabled.",
    "WARNING:dflash.data:shard {n}: read error (Connection reset by peer), retrying (1/3)",
    "UserWarning: attention mask row of all -inf replaced to avoid nan (not an error)",
    "[W1129 10:14:02.{n:06d} 4242 torch/_dynamo/convert_frame.py:1016] torch._dynamo hit "
    "config.recompile_limit (8); consider error_on_recompile=False",
    "data check: {n} samples, 0 errors, 41 dropped",
]
PLANTED_TRACEBACK = [
    "drafter-{d} failed:",
    "Traceback (most recent call last):",
    '  File "/root/dflash/current/dflash/pipeline/drafter_worker.py", line 211, in run',
    "    loss = self._train_step(batch)",
    '  File "' + SP + '/torch/nn/modules/linear.py", line 125, in forward',
    "    return F.linear(input, self.weight, self.bias)",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU {d} has a "
    "total capacity of 139.72 GiB of which 1.12 GiB is free.",
]


def make_log(num_lines: int, seed: int = 1) -> tuple[list[str], int]:
    """A training log of `num_lines` lines and the number of crashes planted in it."""
    rng = random.Random(seed)
    lines: list[str] = []
    planted = 0
    step = 0
    next_crash = num_lines // 4
    while len(lines) < num_lines:
        r = rng.random()
        if r < 0.55:
            step += 1
            lines.append(
                f"step {step}/1000000 | loss {2.5 * rng.random() + 0.5:.2f} | acc {rng.random():.2f}"
                f" | tau~ {1 + 4 * rng.random():.1f} | lr 5.9e-4 | {1700 + rng.randint(0, 200)} tok/s"
                f" | mfu {40 + 2 * rng.random():.1f}% | queue {rng.randint(0, 8)}/8"
            )
        elif r < 0.75:
            d = rng.randint(0, 7)
            what = rng.choice(["step replay", "fwd 88.1 ms bwd 150.2 ms", "waiting for batch"])
            lines.append(f"drafter-{d} on cuda:{d}: {what}")
        elif r < 0.82:
            lines.append(rng.choice(WARNINGS).format(n=len(lines)))
        elif r < 0.88:
            lines.append(
                f"host:{rng.randint(1000, 9999)}:{rng.randint(1000, 9999)} [{rng.randint(0, 7)}] "
                "NCCL INFO Channel 03/0 : 2[2] -> 3[3] via P2P/CUMEM/read"
            )
        elif r < 0.90:
            pct = rng.randint(0, 100)
            lines.append(
                f"eval: {pct}%|{'#' * (pct // 10):<10}| {pct}/100\reval: {min(pct + 1, 100)}%|"
            )
        elif r < 0.92:
            lines.append(
                f"step {step}/1000000 | loss 2.11 | grad_norm: nan | skipped optimizer step"
            )
        elif r < 0.97:
            lines.append("eval | tau 2.41 | lossless yes | 512 tokens | 3.1 tokens/target forward")
        else:
            lines.append(
                f"prefetcher: queue {rng.randint(0, 8)}/8, {rng.randint(100, 900)} samples/s"
            )
        if len(lines) >= next_crash and next_crash < num_lines - 100:
            d = rng.randint(0, 7)
            for i, text in enumerate(PLANTED_TRACEBACK):
                lines.append(text.format(d=d))
                if i in (2, 4):  # another thread keeps printing in the middle
                    lines.append(f"step {step}/1000000 | loss 2.01 | acc 0.50 | queue 3/8")
            planted += 1
            next_crash += num_lines // 4
    return lines[:num_lines], planted


def run_detector(lines: list[str]) -> tuple[float, int]:
    detector = CrashDetector(load_rules())
    start = time.perf_counter()
    feed = detector.feed
    for line in lines:
        feed(line)
    detector.finish(0)
    return time.perf_counter() - start, len(detector.crashes)


def run_naive(lines: list[str]) -> tuple[float, int]:
    """Every rule regex and every traceback-shape regex on every line."""
    patterns: list[re.Pattern[str]] = [
        _STAGE,
        _ANNOUNCE_FAILED,
        _ANNOUNCE_THREAD,
        _FRAME,
        _EXCEPTION,
    ]
    for rule in load_rules():
        patterns += rule.patterns
        patterns += rule.unless
    rule_patterns = patterns[5:]
    start = time.perf_counter()
    hits = 0
    for line in lines:
        for pattern in patterns:
            pattern.search(line)
        if any(p.search(line) for p in rule_patterns):
            hits += 1
    return time.perf_counter() - start, hits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--baseline-lines", type=int, default=200_000)
    args = parser.parse_args()

    lines, planted = make_log(args.lines)
    seconds, found = run_detector(lines)
    rate = len(lines) / seconds
    base_lines = lines[: args.baseline_lines]
    base_seconds, base_hits = run_naive(base_lines)
    base_rate = len(base_lines) / base_seconds

    print(f"log: {len(lines):,} lines, {planted} planted crashes")
    print(f"CrashDetector.feed: {rate:,.0f} lines/s ({seconds:.2f} s), {found} crashes found")
    print(f"naive (every regex on every line, {len(base_lines):,} lines): {base_rate:,.0f} lines/s")
    print(f"speed-up over naive: {rate / base_rate:.1f}x")
    ok = rate >= TARGET_LINES_PER_S and found == planted
    verdict = "met" if ok else "NOT met"
    print(f"target {TARGET_LINES_PER_S:,} lines/s with every planted crash found: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
