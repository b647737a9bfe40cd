"""What the trainer's config check before the stop costs a deploy.

The agent runs the entry script once with DFLASH_CHECK_CONFIG=1 (agent/trainer_check.py)
inside the launch call, before the old run is stopped: no extra round trip, one more
process in the container. On the loopback test host (real sshd on 127.0.0.1, a test
container), with the real trainer, this times:

  check alone      the trainer reading its config with DFLASH_CHECK_CONFIG=1 in the
                   container (what the launch waited for before the check started ahead)
  with check       `dflashctl deploy --detach` of a one-file change, the bundled trainer:
                   the check's interpreter started with the upload's agent, while the
                   client plans (agent/trainer_check.py's prestart)
  cold check       the same with the workdir's .trainer-check.json removed before each
                   deploy: the agent has nothing to start ahead, and the check starts
                   after the release is built, on the deploy's path (as before 2026-12-05)
  without check    the same with an entry script that does not name the variable (the
                   agent then does not run it); the three alternate

For the two cases with a check, it also prints how long the launch waited for the check
(the deploy's `check_seconds`): what the check still adds to the deploy's path, without
the noise of the whole deploy's time on a loaded machine.

Between deploys the launched run is killed, so no deploy stops a run or competes with
one for the CPU.

    python bench/bench_trainer_check.py [--runs N]
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
from tests.host.containers import Container  # noqa: E402

VMID = 200
WORKDIR = "/root/dflash"
ENTRY = "train_dflash_pipeline.py"
ARGS = ["--config", "configs/tiny-cpu.yaml", "--set", "train.steps=5"]


def copy_trainer(dest: Path, *, checkable: bool) -> None:
    shutil.copytree(ROOT / "trainer", dest, ignore=shutil.ignore_patterns("__pycache__"))
    if not checkable:  # the agent runs only an entry script that names the variable
        entry = dest / ENTRY
        entry.write_text(entry.read_text().replace("DFLASH_CHECK_CONFIG", "DFLASH_NO_CHECK"))


def deploy(config: Path, cache: Path) -> tuple[float, float | None]:
    """The deploy's wall time, and how long its launch waited for the config check
    (the summary's check_seconds: what the check still costs the deploy's path)."""
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "dflashctl", "deploy", "-c", str(config), "--detach", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"deploy failed ({done.returncode}):\n{done.stderr}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return elapsed, summary["nodes"][0].get("check_seconds")


def kill_runs(container: Container) -> None:
    container.exec(["sh", "-c", "pkill -KILL -f '[t]rain_dflash_pipeline'; sleep 1"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="deploys timed per case")
    args = parser.parse_args()
    why_not = loopback_problem()
    if why_not:
        print(f"skipped: {why_not}")
        return 0
    with loopback_host("bench-trainer-check-", VMID) as host:
        base, server, container = host.base, host.server, host.container
        configs = {}
        cases = (("with check", True), ("cold check", True), ("without check", False))
        for name, checkable in cases:
            source = base / name.replace(" ", "-")
            copy_trainer(source, checkable=checkable)
            config = fixtures.build_config(server, vmid=VMID, trainer_source=source)
            config["trainer"].update(entry=ENTRY, args=ARGS)
            config["container"]["workdir"] = f"{WORKDIR}-{source.name}"
            config["run"]["stop_grace_s"] = 5
            path = base / f"{source.name}.yaml"
            path.write_text(yaml.safe_dump(config))
            configs[name] = (path, source, base / f"cache-{source.name}")
            deploy(path, configs[name][2])  # the first deploy: every file travels
            kill_runs(container)
        python = sys.executable
        release = f"{WORKDIR}-with-check/current"
        alone = []
        for _ in range(args.runs):
            start = time.perf_counter()
            command = f"cd {release} && DFLASH_CHECK_CONFIG=1 exec {python} {ENTRY} " + " ".join(
                ARGS
            )
            done = container.exec(["sh", "-c", command], timeout=300)
            alone.append(time.perf_counter() - start)
            assert done.returncode == 0, done.stderr
        times: dict[str, list[float]] = {name: [] for name in configs}
        waits: dict[str, list[float]] = {name: [] for name in configs}
        for i in range(args.runs):
            for name, (path, source, cache) in configs.items():
                (source / "edited.py").write_text(f"EDIT = {i}\n")
                if name == "cold check":
                    spec = container.host_path(f"{WORKDIR}-{source.name}/.trainer-check.json")
                    spec.unlink(missing_ok=True)
                elapsed, waited = deploy(path, cache)
                times[name].append(elapsed)
                if waited is not None:
                    waits[name].append(waited)
                kill_runs(container)
        load = os.getloadavg()
        print(
            f"{os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
            f"at the end; {args.runs} runs per case, medians (min-max)"
        )
        rows = {"check alone (in the container)": alone, **times}
        for name, values in rows.items():
            print(
                f"  {name:32s} {statistics.median(values):6.2f} s "
                f"({min(values):.2f}-{max(values):.2f})"
            )
        for name in ("with check", "cold check"):
            print(
                f"  {name}: the launch waited for it {statistics.median(waits[name]):.3f} s "
                f"({min(waits[name]):.3f}-{max(waits[name]):.3f})"
            )
        without = statistics.median(times["without check"])
        for name in ("with check", "cold check"):
            delta = statistics.median(times[name]) - without
            print(f"  {name} - without (medians)  {delta:+6.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
