"""dflash.yaml's crash_patterns, checked when the config is read.

The rules were checked only where a deploy builds them, so `doctor` passed a config
that `deploy` refused. Checked here, in parse_config, every command that reads the
config refuses the same rules, and each mistake carries the rule's line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflashctl.config.errors import Problem
from dflashctl.config.yaml_source import YamlSource
from dflashctl.errors import ConfigError

_RULE_HINT = "see templates/crash_patterns.yaml for the form of a rule"


def rule_problems(items: Any, source: YamlSource) -> list[Problem]:
    """Every rule's first mistake (a list that is not a list is pydantic's to report)."""
    if not isinstance(items, list):
        return []
    # Imported here: the crash engine compiles its patterns on import (a tenth of a
    # second), which a config without crash_patterns never needs.
    from dflashctl.crash.rules import load_rules, parse_rule

    found: list[Problem] = []
    names: dict[str, int] = {}
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            continue  # reported by the model as "expected a mapping"
        place = source.place(("crash_patterns", index))
        try:
            rule = parse_rule(item, where="", key=f"crash_patterns[{index}]")
        except ConfigError as exc:
            found.append(Problem(place, _without_where(exc.message), exc.hint or _RULE_HINT))
            continue
        except (RecursionError, OverflowError, ValueError, MemoryError) as exc:
            # re.compile on a hostile pattern: nested too deep, a repeat too large.
            found.append(
                Problem(place, f"crash_patterns[{index}]: cannot compile: {exc}", _RULE_HINT)
            )
            continue
        if rule.name in names:
            found.append(
                Problem(
                    source.place(("crash_patterns", index, "name")),
                    f"crash_patterns[{index}].name: {rule.name!r} is already the name of "
                    f"crash_patterns[{names[rule.name]}]",
                    "give each rule its own name (the same name as a built-in rule replaces it)",
                )
            )
        names.setdefault(rule.name, index)
    if not found:
        try:  # the built-in rules file (its own mistakes name that file)
            load_rules(extra=[i for i in items if isinstance(i, Mapping)])
        except ConfigError as exc:
            found.append(Problem(None, exc.message, exc.hint))
    return found


def _without_where(message: str) -> str:
    # parse_rule's sentence is `{where}: {key}: {problem}`; the place is added by us.
    return message[2:] if message.startswith(": ") else message
