"""Trainer config: YAML + --set overrides, unknown keys and bad values are errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from dflash.pipeline import tls
from dflash.pipeline.train_config import (
    FailurePoint,
    TrainConfigError,
    load_train_config,
    parse_fail_in,
)
from dflash.pipeline.warmup import check_device_layout

CONFIGS = Path(__file__).resolve().parents[1] / "trainer" / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "train:\n  steps: 10\nruntime:\n  compile: default\n")
    cfg = load_train_config(
        path,
        [
            "train.steps=25",
            "runtime.drafter_devices=[cpu, cpu]",
            "optim.lr=1e-3",
            "output_dir=/tmp/x",
        ],
    )
    assert cfg.train.steps == 25
    assert cfg.runtime.compile == "default"
    assert cfg.runtime.drafter_devices == ["cpu", "cpu"]
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.resolved_output_dir() == Path("/tmp/x")


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("train:\n  stepz: 3\n", [], "unknown key train.stepz"),
        ("bogus: 1\n", [], "unknown key bogus"),
        (
            "",
            ["runtime.compile=fast"],
            "runtime.compile: 'fast' is not one of eager, default, reduce-overhead, legacy-cudagraphs",
        ),
        ("", ["train.steps=many"], "train.steps: expected an integer"),
        ("", ["runtime.schedule=parallel"], "runtime.schedule"),
        ("", ["runtime.drafter_devices=[gpu0]"], "'gpu0' is not 'cpu' or 'cuda:N'"),
        ("", ["debug.fail_in=drafter-0@later"], "debug.fail_in"),
        ("", ["train"], "expected key=value"),
        ("", ["data.seq_len=4", "drafter.block_size=4"], "at least twice drafter.block_size"),
    ],
)
def test_mistakes_name_the_key(tmp_path, text, overrides, message):
    path = write(tmp_path, text)
    with pytest.raises(TrainConfigError) as info:
        load_train_config(path, overrides)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_output_dir_defaults_to_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_RUN_DIR", str(tmp_path / "runs" / "r1"))
    assert load_train_config(None).resolved_output_dir() == tmp_path / "runs" / "r1" / "outputs"
    monkeypatch.delenv("DFLASH_RUN_DIR")
    assert load_train_config(None).resolved_output_dir() == Path("outputs")


def test_fail_in_forms():
    assert parse_fail_in("drafter-0@warmup") == FailurePoint("drafter-0", "warmup")
    assert parse_fail_in("prefetcher@step:3") == FailurePoint("prefetcher", "step", 3)
    assert parse_fail_in("target-1@start") == FailurePoint("target-1", "start")


@pytest.mark.parametrize("name", ["tiny-cpu", "gpu-smoke", "qwen3-8b"])
def test_shipped_configs_load(name):
    cfg = load_train_config(CONFIGS / f"{name}.yaml")
    assert cfg.train.steps > 0


def test_shipped_gpu_configs_use_cuda_graph_trees():
    for name in ("gpu-smoke", "qwen3-8b"):
        cfg = load_train_config(CONFIGS / f"{name}.yaml")
        assert cfg.runtime.compile == "reduce-overhead"
        assert cfg.debug.tls_fix is True


def test_two_drafters_on_one_gpu_refused_where_torch_shares_graphs(monkeypatch):
    monkeypatch.setattr(tls, "torch_shares_graphs_across_threads", lambda: True)
    with pytest.raises(TrainConfigError, match="cuda:0 holds more than one drafter"):
        check_device_layout(["cuda:0", "cuda:0"], "reduce-overhead")
    check_device_layout(["cuda:0", "cuda:1"], "reduce-overhead")
    check_device_layout(["cuda:0", "cuda:0"], "legacy-cudagraphs")
    check_device_layout(["cpu", "cpu"], "reduce-overhead")
    monkeypatch.setattr(tls, "torch_shares_graphs_across_threads", lambda: False)
    check_device_layout(["cuda:0", "cuda:0"], "reduce-overhead")


def test_entry_point_exits_2_on_unknown_key(tmp_path, capsys):
    import train_dflash_pipeline

    path = write(tmp_path, "optim:\n  learning_rate: 1\n")
    assert train_dflash_pipeline.main(["--config", str(path)]) == 2
    assert "unknown key optim.learning_rate" in capsys.readouterr().err


def test_header_takes_the_commit_from_the_run_metadata(tmp_path, monkeypatch):
    import json

    from dflash.pipeline.logging import git_commit

    (tmp_path / "meta.json").write_text(
        json.dumps({"git_commit": "0123456789abcdef", "git_dirty": True})
    )
    monkeypatch.setenv("DFLASH_RUN_DIR", str(tmp_path))
    assert git_commit(tmp_path) == "0123456789ab (dirty)"


def test_compile_auto_is_cuda_graph_trees_on_gpus_and_eager_on_cpu():
    assert load_train_config(None).runtime.compile == "eager"
    gpu = load_train_config(
        None, ["runtime.drafter_devices=[cuda:0]", "runtime.target_devices=[cuda:0]"]
    )
    assert gpu.runtime.compile == "reduce-overhead"
