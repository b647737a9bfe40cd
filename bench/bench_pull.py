"""`dflashctl pull` of a checkpoint of many small files, against plain `tar` through
one `pct exec`, on the loopback test host (real sshd on 127.0.0.1, `pct` driving a
container), both in the same run:

  pull      the whole CLI process `dflashctl pull RUN --to DIR` (Python start-up, the
            plan with every file's sha256 in the container, one reader stream, each
            file's sha256 checked here)
  tar       `ssh host pct exec 200 -- tar -C <checkpoint> -cf - . | tar -xf -`: the
            same files, nothing checked

The ratio pull / tar is the figure of merit (the goal: within 2x). The cases alternate
within each run, so that a change in the machine's load reaches both. Each lands in a
new folder; the last one is moved aside, not deleted just before: on journal-less ext4
a folder's new files scan past every inode freed there in the last minute (see
bench/results/HISTORY.md), which made either case slow by turns.

    python bench/bench_pull.py [--files 2000 100000] [--size 512] [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from bench.loopback_host import loopback_host  # noqa: E402
from bench.loopback_host import problem as loopback_problem  # noqa: E402
from tests.host import fixtures  # noqa: E402

VMID = 200
WORKDIR = "/root/dflash"
RUN_ID = "20261204-120000-be4c"
STEP = "step-000010"
GOAL_RATIO = 2.0


def make_run(host, files: int, size: int) -> str:
    """A finished run whose checkpoint holds `files` files of `size` bytes, written
    straight into the container's disk; the checkpoint's path there."""
    run = host.container.host_path(f"{WORKDIR}/runs/{RUN_ID}")
    shutil.rmtree(run, ignore_errors=True)
    ckpt = run / "outputs" / "checkpoints" / STEP
    for i in range(files):
        path = ckpt / f"shard-{i // 1000:03d}" / f"part-{i:06d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    (run / "outputs" / "checkpoints" / "latest").write_text(STEP + "\n")
    (run / "meta.json").write_text(json.dumps({"run_id": RUN_ID}))
    (run / "exit_code").write_text("0\n")
    return f"{WORKDIR}/runs/{RUN_ID}/outputs/checkpoints/{STEP}"


def set_aside(dest: Path) -> None:
    """The last run's folder out of the way, deleted with the host at the end."""
    if dest.exists():
        aside = dest.parent / "aside"
        aside.mkdir(exist_ok=True)
        dest.rename(aside / f"{dest.name}-{time.monotonic_ns()}")


def time_pull(config: Path, dest: Path) -> float:
    set_aside(dest)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "dflashctl", "pull", RUN_ID, "--to", str(dest), "-c", str(config)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"pull failed: {done.stderr}")
    return seconds


def time_tar(host, folder: str, dest: Path) -> float:
    set_aside(dest)
    dest.mkdir(parents=True)
    start = time.perf_counter()
    sender = subprocess.Popen(
        host.server.ssh_argv("pct", "exec", str(VMID), "--", "tar", "-C", folder, "-cf", "-", "."),
        stdout=subprocess.PIPE,
    )
    subprocess.run(["tar", "-C", str(dest), "-xf", "-"], stdin=sender.stdout, check=True)
    sender.stdout.close()
    if sender.wait() != 0:
        raise SystemExit("tar through pct exec failed")
    return time.perf_counter() - start


def count_files(folder: Path) -> int:
    return sum(len(names) for _, _, names in os.walk(folder))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, nargs="+", default=[2000, 100_000])
    parser.add_argument("--size", type=int, default=512, help="bytes per file")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    why = loopback_problem()
    if why:
        print(f"cannot run: {why}")
        return 2
    print(f"{os.cpu_count()} cores, load average before: {os.getloadavg()[0]:.1f}")
    results = []
    met = True
    with loopback_host("bench-pull-", VMID) as host:
        config = fixtures.build_config(host.server, vmid=VMID)
        path = host.base / "dflash.yaml"
        path.write_text(yaml.safe_dump(config))
        for files in args.files:
            folder = make_run(host, files, args.size)
            pulls, tars = [], []
            for _ in range(args.runs):
                tars.append(time_tar(host, folder, host.base / "by-tar"))
                pulls.append(time_pull(path, host.base / "pulled"))
            pulled = count_files(host.base / "pulled" / "checkpoints" / STEP)
            assert pulled == files, f"pulled {pulled} of {files} files"
            pull_s, tar_s = statistics.median(pulls), statistics.median(tars)
            ratio = pull_s / tar_s
            met &= ratio <= GOAL_RATIO
            line = (
                f"{files:>7} files of {args.size} B: pull {pull_s:6.2f} s, tar through pct exec "
                f"{tar_s:6.2f} s, ratio {ratio:4.2f} (medians of {args.runs}; "
                f"pull {', '.join(f'{s:.2f}' for s in pulls)}; tar {', '.join(f'{s:.2f}' for s in tars)})"
            )
            print(line, flush=True)
            results.append({"files": files, "pull_s": pulls, "tar_s": tars, "ratio": ratio})
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(f"goal (pull within {GOAL_RATIO:g}x of tar) {'met' if met else 'NOT met'}")
    print(json.dumps(results))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
