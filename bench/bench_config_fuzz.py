"""Thousands of fuzzed dflash.yaml files through doctor and deploy: tracebacks, hangs
and disagreements counted (the goal: 0 of each).

Each config is one of tests/config_fuzz.py's mutations of a valid config (alias bombs,
deep nesting, duplicate keys, NaN and infinities, wrong shapes, cut files, random
values at random keys), run in-process through doctor's checks up to "trainer source"
and deploy's load_config, rules_for and preflight. A call still running after
--hang-s is counted as a hang. Also printed: the verdicts, and the slowest config's
time against the median (a ratio, measured in the same run).

    .venv/bin/python bench/bench_config_fuzz.py [--count 1000] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.config_fuzz import (  # noqa: E402
    check_one,
    deploy_verdict,
    hostile_configs,
    make_workspace,
    seeds,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hang-s", type=float, default=30.0)
    args = parser.parse_args()
    root = make_workspace(Path(tempfile.mkdtemp(prefix="dflash-fuzz-")))
    texts = seeds(root)
    path = root / "dflash.yaml"
    failures: collections.Counter[str] = collections.Counter()
    verdicts: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    seconds: list[float] = []
    slowest = {"seconds": 0.0, "text": ""}

    @seed(args.seed)
    @settings(
        max_examples=args.count,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        text = data.draw(hostile_configs(texts))
        start = time.perf_counter()
        failed = check_one(path, text, seconds=args.hang_s)
        seconds.append(time.perf_counter() - start)
        if seconds[-1] > slowest["seconds"]:
            slowest.update(seconds=seconds[-1], text=text)
        if failed:
            failures[failed[0]] += 1
            examples.setdefault(failed[0], f"{failed[1]}\n--- config ---\n{text[:1500]}")
        else:
            verdicts[deploy_verdict(path)[0]] += 1

    one()
    print(f"configs: {len(seconds)}")
    for kind in ("traceback", "hang", "disagreement"):
        print(f"{kind}s: {failures[kind]}")
    print("verdicts (doctor = deploy): " + ", ".join(f"{k} {v}" for k, v in verdicts.items()))
    median = statistics.median(seconds)
    print(
        f"per config: median {median * 1000:.1f} ms, slowest {max(seconds) * 1000:.1f} ms "
        f"({max(seconds) / median:.1f}x the median)"
    )
    print(f"slowest config (its first 300 characters): {slowest['text'][:300]!r}")
    for kind, text in examples.items():
        print(f"\nfirst {kind}:\n{text}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
