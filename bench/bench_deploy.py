"""How long `dflashctl deploy --detach` takes on the loopback test host, against the
by-hand way it replaces.

Starts the test host the tests use (real sshd on 127.0.0.1, `pct` driving a bubblewrap
container), makes a trainer-like tree of about 30 files, and times the whole CLI
process (`dflashctl deploy --detach`, start to "launched", Python start-up included):

  first deploy         an empty workdir in the container, nothing remembered locally:
                       every file travels (two round trips)
  one-file redeploy    one file changed; the previous run is stopped, a new one launched
                       (one round trip: the last deploy's manifest is remembered locally)
  no-change redeploy   nothing changed: no file content may travel (bytes_sent == 0)

The baseline is the loop from the old notes, each step its own ssh process, strict
about the host key: per file `scp` to the host and `ssh ... pct push` into the
container, then `ssh ... pkill` and `ssh ...` to relaunch.

    python bench/bench_deploy.py [--runs N] [--by-hand-runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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
from tests.host.containers import Container  # noqa: E402
from tests.host.sshd import SshServer  # noqa: E402
from tests.json_answers import flat  # noqa: E402
from tests.test_deploy_support import write_trainer  # noqa: E402

VMID = 200
WORKDIR = "/root/dflash"
BY_HAND_DIR = "/root/by-hand"
GOALS = {"first": 1.5, "one_file": 1.0}
RATIO_GOALS = {"tree": 15.0, "one_file": 2.0}


def make_tree(source: Path) -> list[str]:
    """The fake trainer, its helpers and configs, plus modules: 31 files in all."""
    write_trainer(source, extra_files=28)
    shutil.rmtree(source / "__pycache__")
    return sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_file())


def deploy(config: Path, cache: Path) -> tuple[float, dict]:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "dflashctl", "deploy", "-c", str(config), "--detach", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"deploy failed ({result.returncode}):\n{result.stderr}")
    return elapsed, flat(json.loads(result.stdout))


def wipe(container: Container, cache: Path) -> None:
    """An empty workdir, no runs, nothing remembered here: a first deploy."""
    container.exec(["sh", "-c", f"pkill -KILL -f '[t]rain[.]py'; rm -rf {WORKDIR} {BY_HAND_DIR}"])
    shutil.rmtree(cache, ignore_errors=True)


class ByHand:
    """The old loop: one ssh (or scp) process per step, strict host key checking."""

    def __init__(self, server: SshServer, python: str) -> None:
        self.server = server
        self.python = python
        self.options = [
            "-F", "/dev/null", "-i", str(server.identity_file),
            "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={server.known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null",
        ]  # fmt: skip

    def ssh(self, *command: str, allowed: tuple[int, ...] = (0,)) -> None:
        result = subprocess.run(self.server.ssh_argv(*command), capture_output=True)
        if result.returncode not in allowed:
            raise SystemExit(f"by-hand step {command} failed: {result.stderr.decode()}")

    def scp(self, local: Path, remote: str) -> None:
        dest = f"{self.server.user}@{self.server.address}:{remote}"
        subprocess.run(
            ["scp", "-q", *self.options, "-P", str(self.server.port), str(local), dest],
            check=True,
            capture_output=True,
        )

    def deploy(self, source: Path, files: list[str]) -> float:
        start = time.perf_counter()
        folders = sorted({str(Path(BY_HAND_DIR, f).parent) for f in files})
        self.ssh("pct", "exec", str(VMID), "--", "mkdir", "-p", *folders)
        for rel in files:
            staged = f"/tmp/by-hand-{rel.replace('/', '_')}"
            self.scp(source / rel, staged)
            self.ssh("pct", "push", str(VMID), staged, f"{BY_HAND_DIR}/{rel}")
        # pkill answers 1 when nothing was running.
        self.ssh(
            "pct", "exec", str(VMID), "--", "pkill", "-f", f"{BY_HAND_DIR}/train.py", allowed=(0, 1)
        )
        launch = (
            f"cd {BY_HAND_DIR} && setsid {shlex.quote(self.python)} {BY_HAND_DIR}/train.py "
            "--sleep 600 >train.log 2>&1 </dev/null &"
        )
        self.ssh("pct", "exec", str(VMID), "--", "sh", "-c", launch)
        return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="deploys timed per case")
    parser.add_argument("--by-hand-runs", type=int, default=1, help="by-hand whole-tree runs")
    args = parser.parse_args()
    why_not = loopback_problem()
    if why_not:
        print(f"skipped: {why_not}")
        return 0
    with loopback_host("bench-deploy-", VMID) as host:
        return run(args, host.base, host.server, host.container)


def run(args, base: Path, server: SshServer, container: Container) -> int:
    source = base / "src"
    cache = base / "cache"  # what this machine remembers of its last deploy there
    files = make_tree(source)
    config = fixtures.build_config(server, vmid=VMID, trainer_source=source)
    config["trainer"].update(entry="train.py", args=["--sleep", "600"])
    config["run"]["stop_grace_s"] = 5
    config_path = base / "dflash.yaml"
    config_path.write_text(yaml.safe_dump(config))
    size = sum((source / f).stat().st_size for f in files)
    print(
        f"tree: {len(files)} files, {size / 1024:.1f} KiB; host {server.address}:{server.port}, "
        f"CT {VMID}; {args.runs} runs per case (medians)"
    )

    first, one_file, no_change, no_change_bytes = [], [], [], []
    for i in range(args.runs):
        wipe(container, cache)
        elapsed, summary = deploy(config_path, cache)
        assert summary["files_sent"] == len(files), summary
        first.append(elapsed)
        (source / "helpers.py").write_text(
            f"def greeting():\n    return 'hello from the trainer, edit {i}'\n"
        )
        elapsed, summary = deploy(config_path, cache)
        assert summary["files_sent"] == 1 and len(summary["runs_stopped"]) == 1, summary
        one_file.append(elapsed)
        elapsed, summary = deploy(config_path, cache)
        no_change.append(elapsed)
        no_change_bytes.append(summary["bytes_sent"] + summary["archive_bytes"])

    by_hand = ByHand(server, config["container"]["python"])
    hand_tree, hand_one = [], []
    for _ in range(args.by_hand_runs):
        wipe(container, cache)
        hand_tree.append(by_hand.deploy(source, files))
    for _ in range(max(3, args.by_hand_runs)):
        hand_one.append(by_hand.deploy(source, ["helpers.py"]))
    wipe(container, cache)

    results = {
        "first": median(first),
        "one_file": median(one_file),
        "no_change": median(no_change),
        "by_hand_tree": median(hand_tree),
        "by_hand_one_file": median(hand_one),
    }
    ratio_tree = results["by_hand_tree"] / results["first"]
    ratio_one = results["by_hand_one_file"] / results["one_file"]
    print(
        f"dflashctl deploy --detach, first deploy      {results['first']:6.2f} s"
        f"   (goal <= {GOALS['first']} s)"
    )
    print(
        f"dflashctl deploy --detach, one file changed  {results['one_file']:6.2f} s"
        f"   (goal <= {GOALS['one_file']} s)"
    )
    print(
        f"dflashctl deploy --detach, no change         {results['no_change']:6.2f} s"
        f"   bytes sent: {max(no_change_bytes)}"
    )
    print(f"by hand, whole tree ({len(files)} files)            {results['by_hand_tree']:6.2f} s")
    print(f"by hand, one file                            {results['by_hand_one_file']:6.2f} s")
    print(f"ratio whole tree: {ratio_tree:5.1f}x   (goal >= {RATIO_GOALS['tree']:g}x)")
    print(f"ratio one file:   {ratio_one:5.1f}x   (goal >= {RATIO_GOALS['one_file']:g}x)")
    met = (
        results["first"] <= GOALS["first"]
        and results["one_file"] <= GOALS["one_file"]
        and max(no_change_bytes) == 0
        and ratio_tree >= RATIO_GOALS["tree"]
        and ratio_one >= RATIO_GOALS["one_file"]
    )
    print("goals met" if met else "goals NOT met")
    print(
        json.dumps(
            {
                "bench": "deploy",
                **{k: round(v, 3) for k, v in results.items()},
                "ratio_tree": round(ratio_tree, 1),
                "ratio_one_file": round(ratio_one, 1),
                "no_change_bytes_sent": max(no_change_bytes),
                "files": len(files),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
