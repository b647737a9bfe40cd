"""Crash detection latency of `dflashctl logs --follow` on the loopback test host, against
polling the log every 2 s.

Starts the test host the tests use (real sshd on 127.0.0.1, `pct` driving a bubblewrap
container). Each trial launches a trainer-like process in the container whose main
thread logs a step line every 0.5 s (--step-every); after a random 0.8-1.6 s a worker
thread dies with a real Python exception (its traceback goes to the log through
threading's excepthook) while the main thread keeps logging for another second, then
exits 1. The worker notes time.time() in the container just before it raises (the
container shares this machine's clock).

  follow     follow_run over one SSH connection (the code behind `logs -f`); the crash
             counts as reported when its on_crash callback fires.
  baseline   the by-hand way: every 2 s `pct exec <vmid> -- cat train.log` over the same
             kind of SSH connection, classified with the same crash detector.

Latency = report time - write time. Goal: median <= 0.5 s over 20 trials.

    python bench/bench_detection_latency.py [--trials N] [--baseline-trials N] [--step-every S]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from bench.loopback_host import loopback_host  # noqa: E402
from bench.loopback_host import problem as loopback_problem  # noqa: E402
from dflashctl.config.schema import load_config  # noqa: E402
from dflashctl.crash import CrashDetector, load_rules  # noqa: E402
from dflashctl.follow import follow_run  # noqa: E402
from dflashctl.remote.connect import open_target  # noqa: E402
from tests.host import fixtures  # noqa: E402
from tests.host.containers import Container  # noqa: E402
from tests.host.sshd import SshServer  # noqa: E402
from tests.test_follow_support import launch_argv  # noqa: E402

VMID = 200
WORKDIR = "/root/dflash"
GOAL_S = 0.5
POLL_S = 2.0

# argv: CRASH_AFTER_S STEP_EVERY_S. Writes the crash time to ./crash_time (the run
# folder) just before the worker raises.
CRASHING_TRAINER = r"""
import sys, threading, time
crash_after, step_every = float(sys.argv[1]), float(sys.argv[2])

def drafter():
    print("drafter-2 on cpu: warming compiled graphs", flush=True)
    time.sleep(crash_after)
    with open("crash_time.tmp", "w") as f:
        f.write(repr(time.time()))
    import os
    os.replace("crash_time.tmp", "crash_time")
    raise AssertionError("tree manager container missing from this thread")

worker = threading.Thread(target=drafter, name="drafter-2")
worker.start()
started = time.monotonic()
step = 0
while time.monotonic() - started < crash_after + 1.0:
    step += 1
    print(f"step {step}/100 | loss 2.31 | acc 0.52 | 1830 tok/s", flush=True)
    time.sleep(step_every)
worker.join()
sys.exit(1)
"""


class Bench:
    def __init__(
        self, server: SshServer, container: Container, base: Path, step_every: float
    ) -> None:
        self.step_every = step_every
        config = fixtures.build_config(server, vmid=VMID)
        path = base / "dflash.yaml"
        path.write_text(yaml.safe_dump(config))
        self.config = load_config(path)
        self.container = container
        self.rules = load_rules()
        self.count = 0

    def launch(self, crash_after: float) -> tuple[str, Path]:
        self.count += 1
        run_id = f"bench-{self.count:03d}"
        rundir = f"{WORKDIR}/runs/{run_id}"
        argv = [
            self.config.container.python,
            "-u",
            "-c",
            CRASHING_TRAINER,
            f"{crash_after:.3f}",
            str(self.step_every),
        ]
        done = self.container.exec(launch_argv(rundir, argv))
        if done.returncode != 0:
            raise SystemExit(f"launch failed: {done.stderr}")
        return run_id, self.container.host_path(rundir)

    @staticmethod
    def crash_time(host_rundir: Path) -> float:
        deadline = time.monotonic() + 10
        while not (host_rundir / "crash_time").exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"{host_rundir}: the trainer never crashed")
            time.sleep(0.01)
        return float((host_rundir / "crash_time").read_text())

    def follow_trial(self, crash_after: float) -> float:
        target = open_target(self.config)
        try:
            target.run(["true"])  # connected before the run starts, as after a deploy
            run_id, host_rundir = self.launch(crash_after)
            reported: list[float] = []
            result = follow_run(
                lambda: open_target(self.config),
                WORKDIR,
                run_id,
                rules=self.rules,
                target=target,
                python=self.config.container.python,
                show_lines=False,
                on_crash=lambda event: reported.append(time.time()),
            )
        finally:
            target.transport.close()
        if result.status != "crashed" or not reported:
            raise SystemExit(f"{run_id}: the crash was not reported ({result.to_json()})")
        return reported[0] - self.crash_time(host_rundir)

    def baseline_trial(self, crash_after: float) -> float:
        target = open_target(self.config)
        try:
            target.run(["true"])
            run_id, host_rundir = self.launch(crash_after)
            log = f"{WORKDIR}/runs/{run_id}/train.log"
            while True:
                time.sleep(POLL_S)
                text = target.run(["cat", log], check=False).stdout_text
                detector = CrashDetector(self.rules)
                for line in text.splitlines():
                    detector.feed(line)
                detector.flush()
                if detector.crashes:
                    reported = time.time()
                    break
        finally:
            target.transport.close()
        return reported - self.crash_time(host_rundir)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"median": statistics.median(values), "p90": p90, "max": ordered[-1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="follow trials")
    parser.add_argument("--baseline-trials", type=int, default=10, help="poll-every-2s trials")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--step-every", type=float, default=0.5, help="seconds between the main thread's lines"
    )
    args = parser.parse_args()
    why_not = loopback_problem()
    if why_not:
        print(f"skipped: {why_not}")
        return 0
    with loopback_host("bench-latency-", VMID) as host:
        return run(args, Bench(host.server, host.container, host.base, args.step_every))


def run(args, bench: Bench) -> int:
    rng = random.Random(args.seed)
    follow = [bench.follow_trial(rng.uniform(0.8, 1.6)) for _ in range(args.trials)]
    baseline = [bench.baseline_trial(rng.uniform(0.8, 1.6)) for _ in range(args.baseline_trials)]
    f, b = summary(follow), summary(baseline)
    print(
        f"crash written in the container -> reported; {args.trials} follow trials, "
        f"{args.baseline_trials} baseline trials; a log line every {args.step_every:g} s"
    )
    print(
        f"follow (logs -f)        median {f['median']:.3f} s   p90 {f['p90']:.3f} s   "
        f"max {f['max']:.3f} s   (goal: median <= {GOAL_S} s)"
    )
    print(
        f"baseline (cat every 2s) median {b['median']:.3f} s   p90 {b['p90']:.3f} s   "
        f"max {b['max']:.3f} s"
    )
    print(
        f"median / goal: {f['median'] / GOAL_S:.2f}   baseline / follow (medians): "
        f"{b['median'] / f['median']:.1f}x"
    )
    met = f["median"] <= GOAL_S
    print("goal met" if met else "goal NOT met")
    print(json.dumps({
        "bench": "detection_latency",
        "follow": {k: round(v, 3) for k, v in f.items()},
        "baseline": {k: round(v, 3) for k, v in b.items()},
        "trials": args.trials,
        "baseline_trials": args.baseline_trials,
        "step_every_s": args.step_every,
        "ratio_to_goal": round(f["median"] / GOAL_S, 2),
        "speedup_vs_baseline": round(b["median"] / f["median"], 1),
    }))  # fmt: skip
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
