"""Run every benchmark under bench/ in turn (`make bench`).

Each bench_*.py is a standalone script that measures its own baseline in the same
run and prints ratios against it; this runner only sequences them and reports
which failed. GPU benchmarks skip themselves where no CUDA device is present.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def main() -> int:
    scripts = sorted(BENCH_DIR.glob("bench_*.py"))
    failed = []
    for script in scripts:
        print(f"\n=== {script.name} ===", flush=True)
        start = time.monotonic()
        result = subprocess.run([sys.executable, str(script)], cwd=BENCH_DIR.parent)
        print(f"--- {script.name}: exit {result.returncode} in {time.monotonic() - start:.1f} s")
        if result.returncode != 0:
            failed.append(script.name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
        return 1
    print(f"\nall {len(scripts)} benchmarks ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
