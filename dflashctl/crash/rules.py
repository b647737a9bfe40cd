"""Crash rules: loading templates/crash_patterns.yaml plus the user's rules, validated.

A rule names one kind of failure (its category) and says how to recognise it in a log.
Every regex is compiled once here. A rule may also list `keywords`: text one of which
every line it matches contains. The detector merges them into one cheap test, so the
common log line (a step line) costs that test instead of every rule's regexes; a rule
without keywords is tried on every line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dflashctl.errors import ConfigError
from dflashctl.resources import template_path

SEVERITIES = ("fatal", "error", "warning")
SCOPES = ("any", "line", "traceback")
_REQUIRED = ("name", "category", "hint")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
BUILTIN_RULES_FILE = "crash_patterns.yaml"


@dataclass(frozen=True)
class Rule:
    name: str
    category: str
    hint: str
    severity: str = "fatal"
    retryable: bool = False
    scope: str = "any"
    patterns: tuple[re.Pattern[str], ...] = ()
    exception: re.Pattern[str] | None = None
    last_frame: re.Pattern[str] | None = None
    unless: tuple[re.Pattern[str], ...] = ()
    excerpt_after: int = 0
    # Substrings one of which every line matched by `patterns` contains, as the rule
    # states them; None: the rule is tried on every line.
    keywords: tuple[str, ...] | None = field(default=None, compare=False)

    def matches_line(self, line: str) -> bool:
        """A one-line match: some pattern is found and no `unless` pattern is."""
        if not any(p.search(line) for p in self.patterns):
            return False
        return not any(u.search(line) for u in self.unless)


# The keys of a rule's mapping: Rule's fields, its patterns written as `regex`.
_KEYS = {f.name for f in fields(Rule)} - {"patterns"} | {"regex"}


def load_rules(
    extra: Iterable[Mapping[str, Any]] | None = None,
    *,
    builtin_path: Path | None = None,
    source: str = "dflash.yaml",
) -> list[Rule]:
    """The built-in rules plus `extra` (dflash.yaml's crash_patterns), in match order.

    User rules come first so that they win; one with a built-in rule's name replaces it.
    `source` names the file the user rules came from, for error messages.
    """
    path = builtin_path or _builtin_rules_path()
    builtin = parse_rule_list(_read_rules_file(path), where=str(path))
    user = parse_rule_list(list(extra or []), where=source, key="crash_patterns")
    replaced = {rule.name for rule in user}
    return user + [rule for rule in builtin if rule.name not in replaced]


def rule_mappings(
    extra: Iterable[Mapping[str, Any]] | None = None, *, builtin_path: Path | None = None
) -> list[dict[str, Any]]:
    """The rules of load_rules as the plain mappings they were written as, in match
    order (JSON-ready): what a run's supervisor gets, so that it decides with exactly
    the rules dflashctl shows crashes with. Validate with load_rules first."""
    path = builtin_path or _builtin_rules_path()
    user = [dict(item) for item in extra or []]
    replaced = {item.get("name") for item in user}
    builtin = [dict(item) for item in _read_rules_file(path) if item.get("name") not in replaced]
    return user + builtin


def rules_for(config: Any) -> list[Rule]:
    """The rules for a run of this config: the built-in ones plus its crash_patterns,
    whose mistakes are reported against the config file itself."""
    return load_rules(extra=config.crash_patterns, source=str(config.path))


def _builtin_rules_path() -> Path:
    # templates/ next to the package in a checkout; dflashctl/_templates in a wheel.
    try:
        return template_path(BUILTIN_RULES_FILE)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{BUILTIN_RULES_FILE} is missing from this dflashctl installation",
            hint="reinstall dflashctl; the file ships in templates/ (dflashctl/_templates in a wheel)",
        ) from exc


def _read_rules_file(path: Path) -> list[Any]:
    # Imported here: the rest of this module, the detector and events are standard
    # library only, so that they also run where the trainer runs (dflashctl/ops/recovery.py).
    import yaml

    try:
        # libyaml's loader where PyYAML has it: half the time of the pure-Python one
        # for this file, which every deploy reads twice.
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=loader)  # noqa: S506
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read crash rules: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise ConfigError(f"{path}: expected a mapping with a 'rules' list")
    return data["rules"]


def parse_rule_list(items: Sequence[Any], *, where: str, key: str = "rules") -> list[Rule]:
    """Rules from their mappings (rule_mappings' answer), in the order given."""
    rules: list[Rule] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        rule = parse_rule(item, where=where, key=f"{key}[{i}]")
        if rule.name in seen:
            raise ConfigError(f"{where}: {key}[{i}].name: {rule.name!r} is used by an earlier rule")
        seen.add(rule.name)
        rules.append(rule)
    return rules


def parse_rule(data: Any, *, where: str = "dflash.yaml", key: str = "crash_patterns[0]") -> Rule:
    """One rule from its YAML mapping; ConfigError names `where: key.field` and the problem."""

    def fail(field_name: str | None, problem: str) -> ConfigError:
        path = f"{key}.{field_name}" if field_name else key
        return ConfigError(
            f"{where}: {path}: {problem}",
            hint="see templates/crash_patterns.yaml for the form of a rule",
        )

    if not isinstance(data, Mapping):
        raise fail(None, f"expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise fail(unknown[0], f"unknown key; allowed: {', '.join(sorted(_KEYS))}")
    for name in _REQUIRED:
        if not isinstance(data.get(name), str) or not data[name].strip():
            raise fail(name, "missing; a non-empty string is required")
    for name in ("name", "category"):
        if not _NAME.match(data[name]):
            raise fail(name, f"{data[name]!r} must be lower_snake_case")

    for name, allowed in (("scope", SCOPES), ("severity", SEVERITIES)):
        if data.get(name, allowed[0]) not in allowed:  # the first is the default
            raise fail(name, f"{data[name]!r} is not one of {', '.join(allowed)}")
    scope, severity = data.get("scope", "any"), data.get("severity", "fatal")
    retryable = data.get("retryable", False)
    if not isinstance(retryable, bool):
        raise fail("retryable", f"expected true or false, got {retryable!r}")
    excerpt_after = data.get("excerpt_after", 0)
    if type(excerpt_after) is not int or not 0 <= excerpt_after <= 200:  # not a bool either
        raise fail(
            "excerpt_after", f"expected a number of lines from 0 to 200, got {excerpt_after!r}"
        )

    patterns = _compile_list(data.get("regex"), "regex", fail)
    exception = _compile_one(data.get("exception"), "exception", fail)
    last_frame = _compile_one(data.get("last_frame"), "last_frame", fail)
    unless = _compile_list(data.get("unless"), "unless", fail)
    if not patterns and exception is None and last_frame is None:
        raise fail(
            "regex", "missing; give a regex (or exception / last_frame for a traceback rule)"
        )
    if (exception is not None or last_frame is not None) and scope == "line":
        raise fail(
            "scope", "exception and last_frame only apply to tracebacks; use scope traceback or any"
        )
    if not patterns and scope != "traceback":
        scope = "traceback"  # only exception / last_frame: it can only ever match a traceback

    return Rule(
        name=data["name"],
        category=data["category"],
        hint=" ".join(data["hint"].split()),
        severity=severity,
        retryable=retryable,
        scope=scope,
        patterns=patterns,
        exception=exception,
        last_frame=last_frame,
        unless=unless,
        excerpt_after=excerpt_after,
        keywords=_keywords(data.get("keywords"), patterns, fail),
    )


def _compile_list(value: Any, field_name: str, fail) -> tuple[re.Pattern[str], ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (_compile_one(value, field_name, fail),)
    if not isinstance(value, list) or not value:
        raise fail(field_name, "expected a regex or a non-empty list of regexes")
    return tuple(_compile_one(item, f"{field_name}[{i}]", fail) for i, item in enumerate(value))


def _compile_one(value: Any, field_name: str, fail) -> re.Pattern[str] | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise fail(field_name, f"expected a regular expression (a string), got {value!r}")
    try:
        return re.compile(value)
    except re.error as exc:
        raise fail(field_name, f"invalid regular expression {value!r}: {exc}") from exc


# --- keywords ------------------------------------------------------------------------


def _keywords(value: Any, patterns: Sequence[re.Pattern[str]], fail) -> tuple[str, ...] | None:
    """The rule's keywords, checked against its regexes as far as text can be.

    The promise a keyword list makes (every line the rule matches contains one of them)
    is the rule author's: it cannot be proven from a regex with the public API. What is
    checked is that each regex is case-sensitive (keywords are compared exactly) and
    either spells one of the keywords (its text, escapes removed) or matches one, which
    catches a typo or a keyword list meant for another rule. The tests feed real crash
    logs through the built-in rules.
    """
    if value is None:
        return None
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not words or not all(isinstance(w, str) and w for w in words):
        raise fail("keywords", "expected a non-empty string or a list of them")
    if not patterns:
        raise fail("keywords", "only apply to a rule with a regex")
    for i, pattern in enumerate(patterns):
        where = "regex" if len(patterns) == 1 else f"regex[{i}]"
        if pattern.flags & re.IGNORECASE:
            raise fail(
                "keywords",
                f"{where} is case-insensitive but keywords are compared exactly; "
                "drop keywords (the rule is then tried on every line)",
            )
        spelled = _ESCAPED.sub(r"\1", pattern.pattern)
        if not any(word in spelled or pattern.search(word) for word in words):
            raise fail(
                "keywords",
                f"{where} {pattern.pattern!r} neither contains nor matches any of {words}: "
                "every line the rule matches must contain one of its keywords",
            )
    return tuple(words)


_ESCAPED = re.compile(r"\\([^A-Za-z0-9])")  # \. -> .  (\d, \s stay as they are)
