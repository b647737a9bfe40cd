"""ops/deploy_plan.py without a host: the source's local checks, the question before a
big send, and whether a deploy makes a new release or reuses the current one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from dflashctl.config.schema import load_config
from dflashctl.errors import UsageError
from dflashctl.ops import deploy_plan, sync
from dflashctl.ops.deploy_plan import DeployOptions
from dflashctl.reporting import Reporter


def config_for(tmp_path: Path, files: dict[str, bytes], **trainer):
    source = tmp_path / "src"
    for name, data in files.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(data)
    path = tmp_path / "dflash.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "host": {"address": "local"},
                "container": {
                    "vmid": None,
                    "workdir": str(tmp_path / "w"),
                    "python": sys.executable,
                },
                "trainer": {"source": str(source), "entry": "train.py", **trainer},
            }
        )
    )
    return load_config(path)


class Answers(Reporter):
    def __init__(self, answer: bool | None) -> None:
        self.answer = answer
        self.asked: list[str] = []

    def confirm(self, question: str) -> bool | None:
        self.asked.append(question)
        return self.answer


def test_preflight_counts_the_python_files_and_leaves_out_what_exclude_names(tmp_path):
    config = config_for(
        tmp_path,
        {"train.py": b"print(1)\n", "lib/model.py": b"X = 1\n", "data/big.bin": b"0" * 10},
        exclude=["data/"],
    )
    manifest, compiled, skipped = deploy_plan.preflight(config)
    assert sorted(manifest) == ["lib/model.py", "train.py"]
    assert compiled == 2
    assert "data" in skipped.describe(str)


def test_preflight_refuses_an_entry_outside_the_source(tmp_path):
    config = config_for(tmp_path, {"main.py": b"print(1)\n"})
    with pytest.raises(UsageError, match="trainer.entry train.py is not in") as refused:
        deploy_plan.preflight(config)
    assert "set trainer.entry" in refused.value.hint


def test_preflight_refuses_a_file_that_does_not_compile(tmp_path):
    config = config_for(tmp_path, {"train.py": b"print(1)\n", "bad.py": b"def f(:\n"})
    with pytest.raises(UsageError, match="bad.py"):
        deploy_plan.preflight(config)


def big_plan(tmp_path, **trainer):
    config = config_for(
        tmp_path,
        {"train.py": b"print(1)\n", "vocab.txt": b"x" * 3_000_000},
        **trainer,
    )
    manifest, _, _ = deploy_plan.preflight(config)
    return config, deploy_plan.plan_from(config, DeployOptions(), manifest, None, None)


def test_a_send_over_the_limit_asks_and_a_no_sends_nothing(tmp_path):
    config, plan = big_plan(tmp_path, confirm_above_mb=1)
    assert plan.bytes_to_send > 1e6
    said_no = Answers(False)
    with pytest.raises(UsageError, match="nothing was sent"):
        deploy_plan.confirm_size(config, plan, yes=False, report=said_no)
    assert "more than trainer.confirm_above_mb (1 MB); largest: vocab.txt" in said_no.asked[0]
    deploy_plan.confirm_size(config, plan, yes=False, report=Answers(True))


def test_with_nobody_to_ask_only_yes_sends_a_big_release(tmp_path):
    config, plan = big_plan(tmp_path, confirm_above_mb=1)
    with pytest.raises(UsageError, match="nothing was sent") as refused:
        deploy_plan.confirm_size(config, plan, yes=False, report=Answers(None))
    assert "pass --yes" in refused.value.hint
    nobody = Answers(None)
    deploy_plan.confirm_size(config, plan, yes=True, report=nobody)
    assert nobody.asked == []


def test_a_send_under_the_limit_asks_nobody(tmp_path):
    config, plan = big_plan(tmp_path, confirm_above_mb=10)
    asked = Answers(False)
    deploy_plan.confirm_size(config, plan, yes=False, report=asked)
    assert asked.asked == []


def test_an_unchanged_source_reuses_the_release_and_a_change_makes_a_new_one(tmp_path):
    config = config_for(tmp_path, {"train.py": b"print(1)\n"})
    manifest, _, _ = deploy_plan.preflight(config)
    same = deploy_plan.plan_from(config, DeployOptions(), manifest, "r1", manifest)
    assert same.new_release is None and same.release == "r1" and same.bytes_to_send == 0

    (tmp_path / "src" / "train.py").write_text("print(2)\n")
    changed, _, _ = deploy_plan.preflight(config)
    new = deploy_plan.plan_from(config, DeployOptions(fresh=True), changed, "r1", manifest)
    assert new.new_release not in (None, "r1") and new.release == new.new_release
    assert new.diff.changed == ["train.py"] and new.fresh
    assert new.bytes_to_send == sync.sent_size(changed["train.py"])
    # Nothing deployed before: everything travels, as a new release.
    first = deploy_plan.plan_from(config, DeployOptions(), manifest, None, None)
    assert first.new_release and first.diff.changed == ["train.py"]
