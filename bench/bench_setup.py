"""What setup costs a deploy: a one-file deploy without setup (the baseline) against
the same deploy with a requirements file whose venv this machine saw made (no extra
round trip), one that only checks the venv is there (streamed, "up to date"), and one
that makes it (a venv with one wheel from a --find-links folder, pip's own time).

    python bench/bench_setup.py --runs 3

Runs against the tests' real SSH host (sshd on 127.0.0.1, a test container); numbers
are medians, printed with their ratio to the baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.loopback_host import loopback_host  # noqa: E402
from bench.loopback_host import problem as loopback_problem  # noqa: E402
from tests.host import fixtures  # noqa: E402
from tests.setup_support import build_wheel  # noqa: E402

VMID = 200
WORKDIR = "/root/dflash"
TRAINER = "import time\nprint('hello', flush=True)\ntime.sleep(600)\n"


def deploy(config: Path, cache: Path) -> float:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "dflashctl", "deploy", "-c", str(config), "--detach"],
        capture_output=True,
        text=True,
        env=env,
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"deploy failed ({done.returncode}):\n{done.stderr}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    why_not = loopback_problem()
    if why_not:
        print(f"skipped: {why_not}")
        return 0
    with loopback_host("bench-setup-", VMID) as host:
        base, container = host.base, host.container
        source, cache = base / "src", base / "cache"
        source.mkdir()
        build_wheel(source / "wheels", "hello-pkg", "1.0", "VALUE = 1\n")
        config = fixtures.build_config(host.server, vmid=VMID, trainer_source=source)
        config["trainer"].update(entry="train.py", args=[])
        config["run"]["stop_grace_s"] = 5
        config["setup"] = {"pip_args": ["--no-index", "--find-links", "wheels"]}
        path = base / "dflash.yaml"
        path.write_text(yaml.safe_dump(config))
        times: dict[str, list[float]] = {
            "baseline": [],
            "remembered": [],
            "checked": [],
            "made": [],
        }
        edit = 0

        def one_file_deploy(case: str) -> None:
            nonlocal edit
            edit += 1
            (source / "train.py").write_text(TRAINER + f"# edit {edit}\n")
            times[case].append(deploy(path, cache))

        (source / "train.py").write_text(TRAINER)
        deploy(path, cache)
        for _ in range(args.runs):
            one_file_deploy("baseline")
        (source / "requirements.txt").write_text("hello-pkg==1.0\n")
        for _ in range(args.runs):
            container.exec(["sh", "-c", f"rm -rf {WORKDIR}/venvs"])
            shutil.rmtree(cache / "dflashctl" / "setups", ignore_errors=True)
            one_file_deploy("made")
            one_file_deploy("remembered")
            shutil.rmtree(cache / "dflashctl" / "setups", ignore_errors=True)
            one_file_deploy("checked")
        baseline = statistics.median(times["baseline"])
        print(f"one-file deploys, medians of {args.runs}, CT {VMID} on {host.server.address}")
        for case, label in (
            ("baseline", "no setup (baseline)"),
            ("remembered", "setup unchanged, seen made here"),
            ("checked", "setup unchanged, checked in the container"),
            ("made", "setup made (venv + 1 wheel)"),
        ):
            value = statistics.median(times[case])
            print(f"  {label:44s} {value:6.2f} s  {value / baseline:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
