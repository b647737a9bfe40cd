"""`dflashctl logs -n 2` on a finished run whose train.log holds 10^6 step lines
(about 70 MiB), on this machine (host.address local), this checkout against an older
one (`--before`, a git revision: its dflashctl/ is taken with `git archive` and run the
same way), alternating within the run so that the machine's load reaches both.

    python bench/bench_logs_tail.py [--lines 1000000] [--runs 3] [--before 805019a]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "20261204-120000-7a11"


def make_run(workdir: Path, lines: int) -> None:
    rundir = workdir / "runs" / RUN_ID
    rundir.mkdir(parents=True)
    with open(rundir / "train.log", "w") as log:
        for i in range(1, lines + 1):
            log.write(f"step {i}/{lines} | loss 2.0000 | acc 0.50 | tau~ 2.00 | 9000 tok/s\n")
    (rundir / "exit_code").write_text("0\n")


def timed(pythonpath: Path, config: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(pythonpath), NO_COLOR="1")
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "dflashctl", "logs", "-n", "2", RUN_ID, "-c", str(config)],
        capture_output=True,
        text=True,
        env=env,
        cwd=config.parent,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0 or done.stdout.count("\n") != 2:
        raise SystemExit(f"logs -n 2 failed ({pythonpath}): {done.stdout[-500:]}{done.stderr}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before", default="805019a")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores, load average before: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="bench-logs-") as scratch:
        base = Path(scratch)
        before = base / "before"
        before.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.before, "dflashctl", "templates"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        workdir = base / "workdir"
        make_run(workdir, args.lines)
        config = base / "dflash.yaml"
        config.write_text(
            f"host: {{address: local}}\n"
            f"container: {{vmid: null, workdir: {workdir}, python: {sys.executable}}}\n"
        )
        size = (workdir / "runs" / RUN_ID / "train.log").stat().st_size
        olds, news = [], []
        for _ in range(args.runs):
            olds.append(timed(before, config))
            news.append(timed(ROOT, config))
    old, new = statistics.median(olds), statistics.median(news)
    print(
        f"logs -n 2, {args.lines} lines ({size / 2**20:.0f} MiB), finished run: "
        f"{args.before} {old:.2f} s, now {new:.2f} s, ratio now/before {new / old:.3f} "
        f"(medians of {args.runs}; before {', '.join(f'{s:.2f}' for s in olds)}; "
        f"now {', '.join(f'{s:.2f}' for s in news)})"
    )
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
