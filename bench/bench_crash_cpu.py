"""The crash detector's CPU time per line, this tree against another (e.g. the main
branch unpacked with `git archive main dflashctl templates bench | tar -x -C DIR`),
in one run: CPU seconds (time.process_time), not wall time, so that a loaded machine
shifts both alike. Lines: bench_crash_matching.make_log (a realistic noisy log).

    .venv/bin/python bench/bench_crash_cpu.py [--against DIR] [--lines 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
MEASURE = r"""
import importlib.util, sys, time
root = sys.argv[1]
sys.path.insert(0, root)
spec = importlib.util.spec_from_file_location("b", root + "/bench/bench_crash_matching.py")
b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)
from dflashctl.crash import CrashDetector, load_rules
lines, _ = b.make_log(int(sys.argv[2]))
rules = load_rules()
detector = CrashDetector(rules)
started = time.process_time()
for line in lines:
    detector.feed(line)
detector.finish(1)
print(len(lines) / (time.process_time() - started), len(detector.crashes))
"""


def measure(root: Path, lines: int) -> tuple[float, int]:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(root), str(lines)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[0]), int(out[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another tree to compare with")
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    roots = [HERE] + ([args.against.resolve()] if args.against else [])
    best = {root: 0.0 for root in roots}
    for _ in range(args.rounds):  # interleaved: both see the same load
        for root in roots:
            rate, found = measure(root, args.lines)
            best[root] = max(best[root], rate)
    for root in roots:
        print(f"{root}: {best[root]:,.0f} lines per CPU second (best of {args.rounds})")
    if args.against:
        print(f"ratio this tree / other: {best[HERE] / best[args.against.resolve()]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
