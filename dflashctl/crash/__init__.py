"""Crash-pattern detection for training logs.

rules = rules_for(config)   # built-in rules + dflash.yaml's crash_patterns
detector = CrashDetector(rules)
for line in lines:
    for event in detector.feed(line):
        render_crash(console, event)
detector.finish(exit_code)
detector.crashes  # root cause first
"""

from dflashctl.crash.detector import CrashDetector, classify_text
from dflashctl.crash.events import CrashEvent
from dflashctl.crash.rules import Rule, load_rules, rules_for

__all__ = ["CrashDetector", "CrashEvent", "Rule", "classify_text", "load_rules", "rules_for"]
