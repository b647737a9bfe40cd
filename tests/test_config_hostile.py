"""dflash.yaml from someone else: bombs, deep nesting, duplicate keys, NaN, wrong
shapes. Each is a config error (exit 2) naming the line, from every command that reads
the config, never a traceback or a hang."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dflashctl.config.schema import parse_config
from dflashctl.errors import ConfigError
from tests.config_fuzz import alias_bomb
from tests.json_answers import flat

MINIMAL = "host:\n  address: local\ncontainer:\n  vmid: null\n  workdir: /srv/dflash-test\n"


def cli(tmp_path: Path, text: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "dflash.yaml").write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def refused(text: str, tmp_path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, tmp_path / "dflash.yaml")
    return caught.value.message


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        (alias_bomb(9, 8), "line 14, column 13: refused: its aliases expand to more than 100,000"),
        ("deep: " + "[" * 2000 + "\n", "line 7, column 7: refused: nested more than 64"),
        ("deep: " + "[" * 20000 + "]" * 20000 + "\n", "refused: nested more than 64"),
        ("loop: &a [*a]\n", "line 7, column 11: refused: an alias refers to the collection"),
    ],
    ids=["bomb-9x8", "deep-2000", "deep-20000", "self-alias"],
)
@pytest.mark.parametrize("command", [["doctor"], ["deploy", "--dry-run"]])
def test_hostile_yaml_is_a_config_error_naming_the_line(tmp_path, snippet, expected, command):
    result = cli(tmp_path, MINIMAL + "run: {}\n" + snippet, *command)
    assert result.returncode == 2, result.stderr
    assert expected in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_limits_on_aliases_and_size(tmp_path):
    many = "a: &a 1\nlist: [" + ", ".join(["*a"] * 300) + "]\n"
    assert "refused: more than 256 aliases" in refused(MINIMAL + many, tmp_path)
    big = MINIMAL + "trainer:\n  args:\n" + "    - x\n" * 200_000
    assert "refused: the file is 1,600," in refused(big, tmp_path)
    # A bomb under the total is fine: aliases are not refused as such.
    small = MINIMAL + "run:\n  on_exit: x\n" + alias_bomb(3, 3).replace("bomb", "trainer_")
    assert "unknown key trainer_0" in refused(small, tmp_path)


def test_duplicate_keys_name_both_lines(tmp_path):
    message = refused(MINIMAL + "run:\n  keep_releases: 3\n  keep_releases: 4\n", tmp_path)
    assert message.endswith(
        "line 8, column 3: run.keep_releases is written twice, at line 7 and line 8"
    )
    top = refused("run: {}\n" + MINIMAL + "run: {}\n", tmp_path)
    assert "run is written twice, at line 1 and line 7" in top
    # Merge keys may override what they merge: that is not a duplicate.
    merged = "base: &b {address: local}\n" + "host:\n  <<: *b\n  address: local\n"
    assert "written twice" not in refused(merged, tmp_path)  # only `base` is wrong


def test_every_mistake_is_listed_at_once(tmp_path):
    text = (
        "host:\n  address: local\n  adress: x\n"
        "run:\n  stop_grace_s: .nan\n  retry:\n    max_backoff_s: .inf\n"
        "container:\n  vmid: .nan\n"
    )
    message = refused(text, tmp_path)
    lines = message.splitlines()
    assert lines[0].endswith("dflash.yaml: 4 mistakes")
    assert "line 3, column 3: unknown key host.adress (did you mean host.address?)" in lines[1]
    assert "hint: allowed keys in host:" in lines[2]
    assert "line 5, column 17: run.stop_grace_s: expected a finite number" in message
    assert "line 7, column 20: run.retry.max_backoff_s: expected a finite number" in message
    assert "line 9, column 9: container.vmid: expected an integer, got float nan" in message


@pytest.mark.parametrize(
    "value",
    [
        "run:\n  retry:\n    max_backoff_s: .inf\n",
        "run:\n  retry:\n    window_s: -.inf\n",
        "run:\n  stop_grace_s: .nan\n",
        "host:\n  address: local\n  connect_timeout_s: .inf\n",
        "trainer:\n  confirm_above_mb: .nan\n",
        "proxmox:\n  start_timeout_s: .inf\n",
    ],
)
def test_nan_and_infinity_are_refused_wherever_a_number_is_read(tmp_path, value):
    assert "expected a finite number (not .nan or .inf)" in refused(MINIMAL + value, tmp_path)


@pytest.mark.parametrize("shape", ["proxmox: 5\n", "proxmox: [a, b]\n", "container: [1]\n"])
def test_a_section_of_the_wrong_shape_is_refused_with_nodes_too(tmp_path, shape):
    nodes = "nodes:\n  - name: a\n    container: {workdir: /srv/a}\n  - name: b\n"
    nodes += "    container: {workdir: /srv/b}\n"
    section = shape.split(":")[0]
    for text in (MINIMAL.replace("container:\n  vmid: null\n  workdir: /srv/dflash-test\n", "")
                 + shape, MINIMAL.replace("container:\n  vmid: null\n  workdir: /srv/dflash-test\n", "")
                 + shape + nodes):  # fmt: skip
        assert f"{section}: expected a mapping" in refused(text, tmp_path)


BAD_RULES = [
    {"name": "x", "category": "oom", "hint": "h", "regex": "("},
    {"name": "x", "category": "oom", "hint": "h"},
    {"name": "Bad", "category": "oom", "hint": "h", "regex": "a"},
    {"name": "x", "category": "oom", "hint": "h", "regex": "a", "scope": "nowhere"},
    {"name": "x", "category": "oom", "hint": "h", "regex": "a", "severity": "meh"},
    {"name": "x", "category": "oom", "hint": "h", "regex": "a", "keywords": ["zzz"]},
    {"name": "x", "category": "oom", "hint": "h", "regex": "a", "excerpt_after": 1000},
    {"name": "x", "category": "oom", "regex": "a"},
]


@pytest.mark.parametrize("rule", BAD_RULES, ids=lambda r: ",".join(sorted(r)))
def test_doctor_refuses_the_crash_rules_deploy_refuses(tmp_path, rule):
    import json

    text = MINIMAL + "crash_patterns:\n  - " + json.dumps(rule) + "\n"
    doctor = cli(tmp_path, text, "doctor", "--json")
    deploy = cli(tmp_path, text, "deploy", "--dry-run")
    assert doctor.returncode == deploy.returncode == 2, (doctor.stdout, deploy.stderr)
    report = flat(json.loads(doctor.stdout))
    check = next(c for c in report["checks"] if c["name"] == "config valid")
    assert check["status"] == "fail"
    assert "line 7, column 5: crash_patterns[0]" in check["detail"]
    assert "line 7, column 5: crash_patterns[0]" in deploy.stderr


def test_two_rules_with_one_name_are_refused_at_the_second(tmp_path):
    rule = '{"name": "x", "category": "oom", "hint": "h", "regex": "a"}'
    message = refused(MINIMAL + f"crash_patterns:\n  - {rule}\n  - {rule}\n", tmp_path)
    assert "line 8, column 14: crash_patterns[1].name: 'x' is already the name of" in message
