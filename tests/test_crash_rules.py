"""Loading and validating crash rules: the built-in file plus dflash.yaml's crash_patterns."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashctl.crash import CrashDetector, load_rules
from dflashctl.crash.rules import parse_rule
from dflashctl.errors import EXIT_USAGE, ConfigError
from tests.crash_support import REQUIRED_CATEGORIES


def user_rule(**overrides):
    rule = {
        "name": "data_corruption",
        "category": "bad_data",
        "regex": r"shard \d+ is corrupt",
        "hint": "Rebuild the shard with make data.",
    }
    rule.update(overrides)
    return rule


def test_builtin_rules_cover_every_category_with_a_hint():
    rules = load_rules()
    assert REQUIRED_CATEGORIES <= {r.category for r in rules}
    for rule in rules:
        assert len(rule.hint) > 80, f"{rule.name}: a hint worth reading says what to do"
        assert rule.severity in ("fatal", "error", "warning")


def test_cudagraph_tls_hint_names_the_fixes():
    hint = next(r.hint for r in load_rules() if r.category == "cudagraph_tls")
    for needed in ("per-thread", "2.12", "2.13", "TLS-safe warm-up", "cudagraph_trees", "Check:"):
        assert needed in hint


def test_user_rules_come_first_and_replace_builtins_of_the_same_name():
    custom_oom = user_rule(name="cuda_oom", category="cuda_oom", regex="OOM!")
    rules = load_rules(extra=[user_rule(), custom_oom])
    assert [r.name for r in rules[:2]] == ["data_corruption", "cuda_oom"]
    assert [r.name for r in rules].count("cuda_oom") == 1
    assert rules[1].patterns[0].pattern == "OOM!"


def test_a_user_rule_finds_its_crash_before_the_builtin_ones():
    detector = CrashDetector(load_rules(extra=[user_rule()]))
    detector.feed("loading shard 12 from /data")
    detector.feed("shard 12 is corrupt: bad magic")
    events = detector.finish(1)
    assert [(e.category, e.rule, e.hint) for e in events] == [
        ("bad_data", "data_corruption", "Rebuild the shard with make data.")
    ]


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (
            user_rule(regex="(unclosed"),
            "dflash.yaml: crash_patterns[0].regex: invalid regular expression '(unclosed': "
            "missing ), unterminated subpattern at position 0",
        ),
        (
            user_rule(regex=["fine", "[bad"]),
            "dflash.yaml: crash_patterns[0].regex[1]: invalid regular expression '[bad': "
            "unterminated character set at position 0",
        ),
        (
            user_rule(category=None),
            "dflash.yaml: crash_patterns[0].category: missing; a non-empty string is required",
        ),
        (
            user_rule(hint=""),
            "dflash.yaml: crash_patterns[0].hint: missing; a non-empty string is required",
        ),
        (
            user_rule(regex=None),
            "dflash.yaml: crash_patterns[0].regex: missing; give a regex (or exception / "
            "last_frame for a traceback rule)",
        ),
        (
            user_rule(regex=[]),
            "dflash.yaml: crash_patterns[0].regex: expected a regex or a non-empty list of regexes",
        ),
        (
            user_rule(severity="bad"),
            "dflash.yaml: crash_patterns[0].severity: 'bad' is not one of fatal, error, warning",
        ),
        (
            user_rule(scope="everywhere"),
            "dflash.yaml: crash_patterns[0].scope: 'everywhere' is not one of any, line, traceback",
        ),
        (
            user_rule(retryable="yes"),
            "dflash.yaml: crash_patterns[0].retryable: expected true or false, got 'yes'",
        ),
        (
            user_rule(name="Bad Name"),
            "dflash.yaml: crash_patterns[0].name: 'Bad Name' must be lower_snake_case",
        ),
    ],
)
def test_invalid_user_rules_are_config_errors_naming_the_key(rule, message):
    with pytest.raises(ConfigError) as caught:
        load_rules(extra=[rule])
    assert str(caught.value) == message
    assert caught.value.exit_code == EXIT_USAGE
    assert caught.value.hint


def test_unknown_keys_and_duplicates_are_reported_with_their_index():
    with pytest.raises(ConfigError, match=r"crash_patterns\[0\]\.regexp: unknown key; allowed: "):
        load_rules(extra=[{**user_rule(), "regexp": "x"}])
    with pytest.raises(ConfigError, match=r"crash_patterns\[1\]\.name: 'data_corruption' is used"):
        load_rules(extra=[user_rule(), user_rule()])
    with pytest.raises(ConfigError, match=r"crash_patterns\[0\]: expected a mapping, got str"):
        load_rules(extra=["shard is corrupt"])


def test_errors_name_the_file_the_rules_came_from():
    with pytest.raises(ConfigError, match=r"^/srv/dflash\.yaml: crash_patterns\[0\]\.regex: "):
        load_rules(extra=[user_rule(regex="(")], source="/srv/dflash.yaml")


def test_a_broken_builtin_rules_file_is_reported(tmp_path):
    broken = tmp_path / "crash_patterns.yaml"
    broken.write_text("rules:\n  - name: x\n    category: y\n    hint: z\n    regex: '('\n")
    with pytest.raises(ConfigError, match=r"crash_patterns\.yaml: rules\[0\]\.regex: invalid"):
        load_rules(builtin_path=broken)


LOGS = Path(__file__).parent / "data" / "logs"
# Lines the built-in rules exist for, in the forms the tools print them, beyond the logs.
EXAMPLE_LINES = [
    "RuntimeError: CUDA error: out of memory",
    "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "step 12 | loss=NaN | acc 0.1",
    "step 12 | loss = -inf",
    "Non-finite loss at step 40",
    "Loss is inf, stopping",
    "[rank1]:[E ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600026 milliseconds before timing out.",
    "Segmentation fault (core dumped)",
    "/bin/sh: line 1:  4242 Killed                  python train.py",
    "Memory cgroup out of memory: Killed process 4242 (python)",
]


def test_every_line_a_builtin_rule_matches_holds_one_of_its_keywords():
    """The keyword promise, on every real log we hold and the example lines."""
    lines = list(EXAMPLE_LINES)
    for log in sorted(LOGS.glob("*.log")):
        lines += log.read_text(encoding="utf-8", errors="replace").splitlines()
    matched = set()
    for rule in load_rules():
        if rule.keywords is None:
            continue
        for line in lines:
            if any(p.search(line) for p in rule.patterns):
                matched.add(rule.name)
                assert any(k in line for k in rule.keywords), (rule.name, line)
    assert {"cuda_oom", "nan_loss", "nccl_watchdog_timeout", "segfault", "killed"} <= matched


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"keywords": ["shard  "]}, r"regex .* neither contains nor matches any of \['shard  '\]"),
        (
            {"keywords": "corrupt", "regex": r"(?i)shard \d+ is corrupt"},
            "regex is case-insensitive",
        ),
        ({"keywords": [3]}, "expected a non-empty string or a list of them"),
        ({"keywords": []}, "expected a non-empty string or a list of them"),
    ],
)
def test_keywords_that_cannot_belong_to_the_regexes_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=r"crash_patterns\[0\]\.keywords: " + message):
        parse_rule(user_rule(**overrides))


def test_a_rule_with_keywords_is_tried_only_on_lines_holding_one():
    keyed = parse_rule(user_rule(keywords=["is corrupt"]))
    assert keyed.keywords == ("is corrupt",)
    detector = CrashDetector([keyed])
    detector.feed("shard 3 is corrupt")
    assert [e.rule for e in detector.finish(1)] == ["data_corruption"]
    # A keyword list that breaks its promise hides the line: the list is the author's word.
    broken = parse_rule(user_rule(regex=r"shard \d+ is (corrupt|bad)", keywords=["corrupt"]))
    detector = CrashDetector([broken])
    detector.feed("shard 3 is bad")
    assert [e.rule for e in detector.finish(0)] == []


def test_a_rule_without_keywords_is_still_tried_on_every_line():
    rule = parse_rule(user_rule(regex=r"(?i)SHARD \d+ IS CORRUPT"))
    assert rule.keywords is None
    detector = CrashDetector([rule])
    detector.feed("Shard 7 is corrupt")
    assert [e.rule for e in detector.finish(1)] == ["data_corruption"]
