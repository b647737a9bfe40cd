"""How many of the real logs in tests/data/logs `logs --file` names right: category,
root-cause rank, node, thread and status as each sidecar says (tests/test_crash_corpus.py
scores one log), and the failing rank among the logs whose sidecar names one.

    python bench/bench_crash_corpus.py [-v]
    PYTHONPATH=/path/to/older/checkout python bench/bench_crash_corpus.py   # an older dflashctl

The corpus and its scoring are this checkout's; dflashctl is whichever comes first on
sys.path (PYTHONPATH before this checkout), so the same logs score the code before a
change and after it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests package, last

import dflashctl  # noqa: E402
import tests.test_crash_corpus as corpus  # noqa: E402


def main(verbose: bool) -> None:
    named = ranks = rank_total = 0
    for log in corpus.CORPUS:
        want = json.loads(log.with_suffix(".expected.json").read_text())
        try:
            wrong = corpus.score(log)
        except Exception as exc:  # noqa: BLE001 - an older dflashctl may lack a field
            wrong = [repr(exc)]
        named += not wrong
        root = want["root_cause"]
        if root and "rank" in root:
            rank_total += 1
            ranks += not any(w.startswith(("root cause rank", "no crash")) for w in wrong)
        if wrong and verbose:
            print(f"  {log.stem}: {'; '.join(wrong)[:300]}")
    print(f"dflashctl: {Path(dflashctl.__file__).parent}")
    print(f"named right {named}/{len(corpus.CORPUS)}; failing rank right {ranks}/{rank_total}")


if __name__ == "__main__":
    main("-v" in sys.argv)
