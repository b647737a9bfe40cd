"""diff_manifests on trees of many files: linear, not quadratic. Times the diff of N and
10 N files in the same run and prints the ratio (linear: about 10; quadratic: about 100).

    .venv/bin/python bench/bench_diff_manifests.py            # 20,000 and 200,000 files
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflashctl.ops.sync import diff_manifests  # noqa: E402


def timed(count: int, repeats: int) -> float:
    local = {f"pkg/m{i:06d}.py": [10, f"{i:064x}", "644"] for i in range(count)}
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        diff_manifests(local, None)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    small, large = timed(args.files, args.repeats), timed(10 * args.files, args.repeats)
    print(
        f"{args.files} files {small * 1000:.1f} ms, {10 * args.files} files {large * 1000:.1f} ms: "
        f"ratio {large / small:.1f} (linear ~10, quadratic ~100)"
    )


if __name__ == "__main__":
    main()
