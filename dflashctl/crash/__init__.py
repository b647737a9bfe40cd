"""Crash-pattern detection for training logs.

rules = rules_for(config)   # built-in rules + dflash.yaml's crash_patterns
detector = CrashDetector(rules)
for line in lines:
    for event in detector.feed(line):
        render_crash(console, event)
detector.finish(exit_code)
detector.crashes  # root cause first (crash/ordering.py), each with its rank and node
detector.stop     # a stop the trainer was asked for: "stopped (checkpoint at step N)"

Modules: detector.py (the streaming detector), trace_parts.py (tracebacks), rules.py,
ranks.py (who wrote a line: [rankN]: prefixes, the trainer's distributed: lines),
torchrun.py (torchrun's failure summary), endings.py (exit status, torchrun's root
cause, error files), error_files.py (torchelastic's error files), ordering.py (root
cause and consequences), stops.py (clean stops), facts.py (a category's particulars).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflashctl.crash.detector import CrashDetector, classify_text
    from dflashctl.crash.events import CrashEvent
    from dflashctl.crash.rules import Rule, load_rules, rules_for

# Each name from its module on first use (PEP 562): a launch needs only rules.py (the
# rules it sends the run's supervisor), and importing the detector compiles every
# pattern of the engine, a tenth of a one-file redeploy's client CPU.
_HOMES = {
    "CrashDetector": "detector",
    "classify_text": "detector",
    "CrashEvent": "events",
    "Rule": "rules",
    "load_rules": "rules",
    "rules_for": "rules",
}

__all__ = ["CrashDetector", "CrashEvent", "Rule", "classify_text", "load_rules", "rules_for"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
