"""The config's parts one at a time: the shared section rules (config/base.py), the run:
and setup: sections, the nodes: merge, crash_patterns' checks and the error sentences
(config/errors.py). The whole file through load_config is tests/test_config.py's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from dflashctl.config import base, crash_patterns, errors, nodes, run, setup
from dflashctl.config.yaml_source import Place, load_yaml
from dflashctl.errors import ConfigError


def message(exc: ValidationError) -> str:
    return exc.errors(include_url=False)[0]["msg"]


def test_numbers_and_booleans_on_a_command_line_are_text():
    assert base.texts(["--steps", 100, 1.5, True, False]) == [
        "--steps",
        "100",
        "1.5",
        "true",
        "false",
    ]
    assert base.text_mapping({"SEED": 3, 4: "x"}) == {"SEED": "3", "4": "x"}
    assert base.scalar_text(None) is None  # left for the type check to refuse


def test_a_relative_path_is_made_absolute_against_the_configs_folder():
    at = SimpleNamespace(context={"base": Path("/proj/cfg")})
    assert base.resolve_path("../src", at) == "/proj/src"
    assert base.resolve_path("/abs/x", at) == "/abs/x"
    assert base.resolve_path("rel", SimpleNamespace(context=None)) == "rel"  # no file: as written


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_no_section_takes_nan_or_infinity(value):
    # `value < 0` is false for NaN: without this a NaN grace would reach a sleep.
    with pytest.raises(ValidationError):
        run.RunConfig(stop_grace_s=value)


def test_the_run_section_refuses_what_cannot_work_and_says_what_would():
    assert run.RunConfig().commit_timeout_s == 120
    with pytest.raises(ValidationError) as info:
        run.RunConfig(commit_timeout_s=-3.0)
    assert message(info.value) == "must be more than 0 seconds, got -3.0"
    with pytest.raises(ValidationError) as info:
        run.RunConfig(start_line="(")
    assert message(info.value).startswith("not a regular expression:")
    with pytest.raises(ValidationError) as info:
        run.RunConfig(gpus=[0, 0])
    assert "distinct whole numbers" in message(info.value)
    assert run.RunConfig(gpus=1).gpus == [1]  # one GPU as a number
    with pytest.raises(ValidationError) as info:
        run.HangConfig(factor=1.0)
    assert message(info.value).startswith("must be more than 1")
    with pytest.raises(ValidationError) as info:
        run.RetryConfig(categories=["Not-A-Category"])
    assert "is not a crash category" in message(info.value)
    with pytest.raises(ValidationError):
        run.RunConfig(unknown=1)  # type: ignore[call-arg]


def test_the_setup_section_keeps_requirements_inside_the_source():
    assert setup.SetupConfig().requirements == setup.DEFAULT_REQUIREMENTS
    assert setup.SetupConfig(requirements=None).requirements is None
    for bad in ("/etc/requirements.txt", "../reqs.txt", " "):
        with pytest.raises(ValidationError) as info:
            setup.SetupConfig(requirements=bad)
        assert message(info.value).startswith("expected a file inside trainer.source")
    with pytest.raises(ValidationError) as info:
        setup.SetupConfig(commands=["pip install .", "  "])
    assert message(info.value) == "an empty command"
    with pytest.raises(ValidationError):
        setup.SetupConfig(timeout_s=0)


def test_a_node_inherits_the_top_level_sections_and_overrides_its_own_keys():
    source = load_yaml(
        "host: {address: gpu-a, user: root}\n"
        "container: {vmid: 200, workdir: /srv}\n"
        "nodes:\n"
        "  - {}\n"
        "  - {host: gpu-b, container: 201}\n"
    )
    merged = nodes.merge_node_sections(source.data, source)
    a, b = merged["nodes"]
    assert a["host"] == {"address": "gpu-a", "user": "root"}
    assert b["host"] == {"address": "gpu-b", "user": "root"}  # the short form, merged
    assert b["container"] == {"vmid": 201, "workdir": "/srv"}
    # A value node b inherits is reported, if wrong, where the top level wrote it.
    assert source.values[("nodes", 1, "host", "user")] == source.values[("host", "user")]
    assert merged["host"] == a["host"]


def test_unnamed_nodes_are_named_after_their_host_and_two_in_one_place_are_refused():
    def node(address, vmid, name=None, workdir="/srv"):
        return SimpleNamespace(
            name=name,
            host=SimpleNamespace(address=address, port=22, user="root"),
            container=SimpleNamespace(vmid=vmid, workdir=workdir),
            label=lambda: None,
        )

    found = [node("gpu-a", 200), node("gpu-b", 300), node("gpu-b", 301)]
    nodes.name_nodes(found)
    assert [n.name for n in found] == ["gpu-a", "gpu-b-300", "gpu-b-301"]
    for n in found:
        n.label = lambda n=n: n.name
    nodes.no_duplicate_nodes(found)  # all distinct
    found.append(node("gpu-a", 200, name="again"))
    found[-1].label = lambda: found[-1].name
    with pytest.raises(PydanticCustomError) as info:
        nodes.no_duplicate_nodes(found)
    assert info.value.message() == "the same container 200 on gpu-a as nodes[0]"
    found[-1].container.vmid = 202
    found[-1].name = "gpu-a"
    with pytest.raises(PydanticCustomError) as info:
        nodes.no_duplicate_nodes(found)
    assert info.value.message() == "node name 'gpu-a' is already the name of nodes[0]"


def test_a_crash_rule_mistake_names_its_line_and_a_repeated_name_both_rules():
    good = "  - {name: my_oom, category: oom, regex: 'out of memory', hint: h}\n"
    source = load_yaml(
        "crash_patterns:\n"
        + good
        + "  - {name: my_oom, category: oom, regex: 'OOM', hint: h}\n"
        + "  - {name: bad, category: oom, regex: '(', hint: h}\n"
        + "  - {name: terse, category: oom, regex: 'x'}\n"
    )
    found = crash_patterns.rule_problems(source.data["crash_patterns"], source)
    assert [(p.place.line, p.text.split(":")[0]) for p in found] == [
        (3, "crash_patterns[1].name"),
        (4, "crash_patterns[2].regex"),
        (5, "crash_patterns[3].hint"),
    ]
    assert "'my_oom' is already the name of crash_patterns[0]" in found[0].text
    assert "invalid regular expression" in found[1].text
    ok = load_yaml("crash_patterns:\n" + good)
    assert crash_patterns.rule_problems(ok.data["crash_patterns"], ok) == []
    assert crash_patterns.rule_problems("not a list", ok) == []


def test_several_mistakes_are_said_at_once_in_the_files_order():
    problems = [
        errors.Problem(Place(7, 3), "run.keep_releases: must be at least 1"),
        errors.Problem(Place(2, 3), "host.port: expected an integer", "e.g. 22"),
        errors.Problem(Place(2, 3), "host.port: expected an integer", "e.g. 22"),  # once
    ]
    err = errors.config_error(Path("d.yaml"), problems)
    assert isinstance(err, ConfigError)
    assert str(err).splitlines() == [
        "d.yaml: 2 mistakes",
        "  d.yaml, line 2, column 3: host.port: expected an integer",
        "    hint: e.g. 22",
        "  d.yaml, line 7, column 3: run.keep_releases: must be at least 1",
    ]
    one = errors.config_error(Path("d.yaml"), problems[1:2])
    assert str(one) == "d.yaml, line 2, column 3: host.port: expected an integer"
    assert one.hint == "e.g. 22"


def test_keys_and_values_are_named_as_a_user_writes_them():
    assert errors.key_path(("nodes", 1, "host", "port")) == "nodes[1].host.port"
    assert errors.describe(None) == "nothing (null)"
    assert errors.describe(True) == "a boolean (true)"
    assert errors.describe("x") == "str 'x'"
    dup = load_yaml("run:\n  keep_releases: 1\n  keep_releases: 2\n")
    (problem,) = errors.duplicate_problems(dup)
    assert problem.text == "run.keep_releases is written twice, at line 2 and line 3"
