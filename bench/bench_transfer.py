"""Big and many-file deploys on the loopback test host, against scp + `pct push` by hand.

Starts the test host the tests use (real sshd on 127.0.0.1, `pct` driving a
container), and times the whole CLI process `dflashctl deploy --detach --yes`
(Python start-up included) with its peak RSS (from wait4):

  big first deploy     the fake trainer plus one incompressible file of --big-mb MB
                       (200 by default), nothing deployed yet
  one-file redeploy    helpers.py changed next to the unchanged big file: nothing of
                       the big file may travel
  many small files     a first deploy of --small-files files (5,000 by default)

Baselines, in the same run, by hand, each step its own `ssh`/`scp` process with strict
host keys: the deploy loop of bench_deploy.py over the same files (`scp` to the host and
`ssh ... pct push` per file, then relaunch), and, stricter, `scp` + `pct push` of the big
file alone.

    python bench/bench_transfer.py [--runs N] [--big-mb MB] [--small-files N]
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

from bench.bench_deploy import VMID, ByHand, wipe  # noqa: E402
from bench.loopback_host import loopback_host  # noqa: E402
from bench.loopback_host import problem as loopback_problem  # noqa: E402
from tests.host import fixtures  # noqa: E402
from tests.test_deploy_support import write_trainer  # noqa: E402

GOALS = {"big_ratio": 1.5, "small_files_s": 1.5, "one_file_s": 1.0, "rss_mib": 150}
BIG_NAME = "assets/reference.dat"  # not in the default excludes: it travels


def write_big(path: Path, megabytes: int) -> None:
    """Incompressible bytes (a checkpoint or a tokenised dataset looks like this)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for i in range(megabytes):
            # Every MiB differs, so no layer can deduplicate it.
            f.write(i.to_bytes(8, "little") + block[8:])
    # A reference checkpoint has sat in the tree for a while, unlike a file saved a
    # second ago (which dflashctl hashes on every deploy, see source_cache.py).
    old = time.time_ns() - 60 * 10**9
    os.utime(path, ns=(old, old))


# The CLI, reporting its own peak RSS (ru_maxrss) on stderr as it exits.
RSS_WRAPPER = (
    "import atexit, resource, sys\n"
    "atexit.register(lambda: sys.stderr.write("
    "f'peak-rss-kib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}\\n'))\n"
    "from dflashctl.cli import main\n"
    "sys.argv[0] = 'dflashctl'\n"
    "main()\n"
)


def deploy(config: Path, cache: Path) -> tuple[float, int, dict]:
    """(seconds, peak RSS in bytes, the --json summary) of one `deploy --detach --yes`."""
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    argv = ["deploy", "-c", str(config), "--detach", "--yes", "--json"]
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", RSS_WRAPPER, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"deploy failed ({result.returncode}):\n{result.stderr}")
    rss = int(result.stderr.rsplit("peak-rss-kib=", 1)[1].split()[0]) * 1024
    return elapsed, rss, json.loads(result.stdout)


def by_hand_big(by_hand: ByHand, big: Path) -> float:
    staged = "/tmp/by-hand-big.dat"
    start = time.perf_counter()
    by_hand.scp(big, staged)
    by_hand.ssh("pct", "push", str(VMID), staged, "/root/by-hand-big.dat")
    elapsed = time.perf_counter() - start
    by_hand.ssh("rm", "-f", staged)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="timed runs per case (medians)")
    parser.add_argument("--big-mb", type=int, default=200, help="size of the big file")
    parser.add_argument("--small-files", type=int, default=5000)
    args = parser.parse_args()
    why_not = loopback_problem()
    if why_not:
        print(f"skipped: {why_not}")
        return 0
    with loopback_host("bench-transfer-", VMID) as host:
        return run(args, host)


def run(args, host) -> int:
    base, server, container = host.base, host.server, host.container
    cache = base / "cache"
    big_src, small_src = base / "big", base / "small"
    write_trainer(big_src)
    shutil.rmtree(big_src / "__pycache__")  # by hand sends every file: no junk in the tree
    write_big(big_src / BIG_NAME, args.big_mb)
    write_trainer(small_src)
    for i in range(args.small_files):
        path = small_src / "pkg" / f"d{i // 500:02d}" / f"m{i:05d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"VALUE = {i}\n")
    configs = {}
    for name, source in (("big", big_src), ("small", small_src)):
        config = fixtures.build_config(server, vmid=VMID, trainer_source=source)
        config["trainer"].update(entry="train.py", args=["--sleep", "600"])
        config["run"]["stop_grace_s"] = 5
        configs[name] = base / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(config))
        python = config["container"]["python"]
    print(
        f"host {server.address}:{server.port}, CT {VMID}; big file {args.big_mb} MB, "
        f"{args.small_files} small files; {args.runs} runs per case (medians)"
    )

    big, one_file, small = [], [], []
    big_rss, one_rss, small_rss = [], [], []
    one_file_archive = []
    for i in range(args.runs):
        wipe(container, cache)
        elapsed, rss, summary = deploy(configs["big"], cache)
        assert summary["files_sent"] == summary["files_total"], summary
        big.append(elapsed)
        big_rss.append(rss)
        (big_src / "helpers.py").write_text(f"def greeting():\n    return 'edit {i}'\n")
        elapsed, rss, summary = deploy(configs["big"], cache)
        # Nothing of the big file travels: the archive holds helpers.py and metadata.
        assert summary["files_sent"] == 1 and summary["bytes_sent"] < 1024, summary
        one_file.append(elapsed)
        one_rss.append(rss)
        one_file_archive.append(summary["archive_bytes"])
        wipe(container, cache)
        elapsed, rss, summary = deploy(configs["small"], cache)
        assert summary["files_sent"] == args.small_files + 3, summary
        small.append(elapsed)
        small_rss.append(rss)
    wipe(container, cache)

    by_hand = ByHand(server, python)
    files = sorted(str(f.relative_to(big_src)) for f in big_src.rglob("*") if f.is_file())
    hand_tree, hand_big = [], []
    for _ in range(args.runs):
        wipe(container, cache)
        hand_tree.append(by_hand.deploy(big_src, files))
        hand_big.append(by_hand_big(by_hand, big_src / BIG_NAME))
    by_hand.ssh("sh", "-c", "rm -f /tmp/by-hand-*")
    wipe(container, cache)

    results = {
        "big_first_s": statistics.median(big),
        "by_hand_tree_s": statistics.median(hand_tree),
        "by_hand_big_s": statistics.median(hand_big),
        "one_file_s": statistics.median(one_file),
        "small_files_s": statistics.median(small),
    }
    ratio = results["big_first_s"] / results["by_hand_tree_s"]
    ratio_big = results["big_first_s"] / results["by_hand_big_s"]
    mib = 1 << 20
    peak = {
        "big": max(big_rss) / mib,
        "one_file": max(one_rss) / mib,
        "small": max(small_rss) / mib,
    }
    big_bytes_sent = max(one_file_archive)
    print(
        f"first deploy, {len(files)} files with {args.big_mb} MB   {results['big_first_s']:6.2f} s"
        f"   peak RSS {peak['big']:.0f} MiB"
    )
    print(f"by hand, the same {len(files)} files, relaunch     {results['by_hand_tree_s']:6.2f} s")
    print(f"by hand, scp + pct push of the big file  {results['by_hand_big_s']:6.2f} s")
    print(f"ratio dflashctl / by hand (same files): {ratio:.2f}   (goal <= {GOALS['big_ratio']})")
    print(f"ratio dflashctl / scp + push of the big file alone: {ratio_big:.2f}")
    print(
        f"one-file redeploy next to the big file     {results['one_file_s']:6.2f} s"
        f"   (goal < {GOALS['one_file_s']} s); archive {big_bytes_sent} bytes, "
        f"peak RSS {peak['one_file']:.0f} MiB"
    )
    print(
        f"first deploy, {args.small_files} small files        {results['small_files_s']:6.2f} s"
        f"   (goal < {GOALS['small_files_s']} s), peak RSS {peak['small']:.0f} MiB"
    )
    met = (
        ratio <= GOALS["big_ratio"]
        and results["one_file_s"] < GOALS["one_file_s"]
        and results["small_files_s"] < GOALS["small_files_s"]
        and big_bytes_sent < (1 << 20)
        and max(peak.values()) < GOALS["rss_mib"]
    )
    print("goals met" if met else "goals NOT met")
    print(
        json.dumps(
            {
                "bench": "transfer",
                **{k: round(v, 3) for k, v in results.items()},
                "ratio_same_files": round(ratio, 2),
                "ratio_big_file_alone": round(ratio_big, 2),
                "one_file_archive_bytes": big_bytes_sent,
                "peak_rss_mib": {k: round(v) for k, v in peak.items()},
                "big_mb": args.big_mb,
                "small_files": args.small_files,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
