"""Trainer config: YAML + --set overrides, unknown keys and bad values are errors."""

from __future__ import annotations

import subprocess
import sys
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

TRAINER = Path(__file__).resolve().parents[1] / "trainer"
CONFIGS = TRAINER / "configs"


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


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        (
            "seed: 1\ntrain:\n  stepz: 3\n",
            [],
            "c.yaml, line 3, column 3: unknown key train.stepz (did you mean train.steps?)",
        ),
        ("optim:\n  lr: fast\n", [], "c.yaml, line 2, column 3: optim.lr: expected a number"),
        (
            "train:\n  steps: 5\n",
            ["train.steps=many"],
            "c.yaml, --set train.steps=many: train.steps: expected an integer, got 'many'",
        ),
        (
            "",
            ["trian.steps=3"],
            "c.yaml, --set trian.steps=3: unknown key trian (did you mean train?)",
        ),
        (
            "runtime:\n  queue_size: 0\n",
            [],
            "c.yaml, line 2, column 3: runtime.queue_size: must be at least 1, got 0",
        ),
        ("eval:\n  enabled: 1\n", [], "c.yaml, line 2, column 3: eval.enabled: expected true or"),
    ],
)
def test_mistakes_say_where_they_were_written(tmp_path, text, overrides, message):
    path = write(tmp_path, text)
    with pytest.raises(TrainConfigError) as info:
        load_train_config(path, overrides)
    assert f"{tmp_path}/{message}" in str(info.value)


def test_overrides_are_typed_like_the_file(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 1e-3\nruntime:\n  drafter_devices: cpu\n")
    from_file = load_train_config(path)
    from_set = load_train_config(None, ["optim.lr=1e-3", "runtime.drafter_devices=cpu"])
    assert from_file.optim.lr == from_set.optim.lr == pytest.approx(1e-3)
    assert from_file.runtime.drafter_devices == from_set.runtime.drafter_devices == ["cpu"]


def test_derived_values_come_from_validation_not_from_changing_the_input():
    from dflash.pipeline.train_config import config_from_dict

    data = {"runtime": {"compile": "auto", "drafter_devices": ["cuda:0"]}}
    cfg = config_from_dict(data)
    assert cfg.runtime.compile == "reduce-overhead"
    assert data == {"runtime": {"compile": "auto", "drafter_devices": ["cuda:0"]}}
    assert config_from_dict(cfg.to_dict()) == cfg  # a resolved config validates to itself


def test_prompt_len_that_leaves_no_response_is_a_config_error(tmp_path):
    with pytest.raises(TrainConfigError, match="data.prompt_len: 60 leaves 4 of data.seq_len"):
        load_train_config(None, ["data.prompt_len=60", "data.seq_len=64"])
    # Only synthetic data continues the prompt; random data has no prompt to fit.
    load_train_config(None, ["data.prompt_len=60", "data.seq_len=64", "data.source=random"])


# ---------------------------------------------------------------- checks before the target


def unreadable_target(tmp_path: Path) -> Path:
    """A model folder whose config.json and tokenizer are fine and whose weights are not:
    anything that loads the target fails on it."""
    from dflash import build_tiny_target
    from dflash.data import build_tiny_tokenizer

    folder = tmp_path / "target"
    build_tiny_target().config.save_pretrained(folder)  # 6 layers
    build_tiny_tokenizer().save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file" * 100)
    return folder


def run_trainer(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\ntrain:\n  steps: 2\n")
    args = [sys.executable, str(TRAINER / "train_dflash_pipeline.py"), "--config", str(config)]
    for item in overrides:
        args += ["--set", item]
    return subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=tmp_path)


@pytest.mark.slow
def test_config_mistakes_fail_before_the_target_is_loaded(tmp_path):
    target = unreadable_target(tmp_path)
    # The weights really are unreadable: a run that gets as far as loading them fails.
    loads = run_trainer(tmp_path, f"target.path={target}")
    assert loads.returncode == 1, loads.stderr
    assert "main failed" in loads.stdout + loads.stderr
    # A prompt that leaves no room for the response: exit 2, the target untouched.
    prompt = run_trainer(tmp_path, f"target.path={target}", "data.prompt_len=60")
    assert prompt.returncode == 2, prompt.stdout + prompt.stderr
    assert "config error:" in prompt.stderr and "data.prompt_len: 60 leaves" in prompt.stderr
    # A drafter that needs more context layers than the target has, seen in config.json.
    layers = run_trainer(tmp_path, f"target.path={target}", "drafter.num_layers=5")
    assert layers.returncode == 2, layers.stdout + layers.stderr
    assert "a target with 6 layers has too few layers" in layers.stderr
    assert "main failed" not in layers.stdout + layers.stderr


def test_a_target_folder_without_config_json_is_a_config_error(tmp_path):
    from dflash.dflash_workload import DFlashWorkload

    (tmp_path / "empty").mkdir()
    cfg = load_train_config(None, [f"target.path={tmp_path / 'empty'}"])
    with pytest.raises(TrainConfigError, match="target.path: cannot read the model config"):
        DFlashWorkload(cfg)


def test_the_trainer_needs_only_its_declared_packages():
    """The container has torch, transformers, safetensors, pydantic and PyYAML (the
    `trainer` extra) and what they bring (numpy, tokenizers, pydantic_core): nothing more."""
    import ast

    declared = {"torch", "transformers", "safetensors", "pydantic", "yaml"}
    brought = {"numpy", "tokenizers", "pydantic_core"}
    # Imported only when logging.wandb / logging.mlflow ask for them (their own extras;
    # a config error names the pip command where they are missing).
    optional = {"wandb", "mlflow"}
    imported = set()
    for file in TRAINER.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"dflash"}
    assert third_party <= declared | brought | optional, third_party - declared - brought
    pyproject = (TRAINER.parent / "pyproject.toml").read_text()
    extra = next(line for line in pyproject.splitlines() if line.startswith("trainer = "))
    for package in ("torch", "transformers", "safetensors", "pydantic", "pyyaml"):
        assert f'"{package}' in extra, package


def test_a_container_without_pydantic_gets_a_sentence_not_a_traceback(tmp_path):
    probe = (
        "import sys, runpy; sys.modules['pydantic'] = None; "
        f"sys.argv = ['train_dflash_pipeline.py', '--config', 'x.yaml']; "
        f"runpy.run_path({str(TRAINER / 'train_dflash_pipeline.py')!r}, run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 1
    assert "cannot import pydantic, which the trainer needs" in result.stderr
    assert "Traceback" not in result.stderr


def test_drafter_config_derives_its_context_layers_and_gamma_when_built():
    from dflash.config import DrafterConfig

    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        num_target_layers=6,
        mask_token_id=511,
        block_size=8,
    )
    cfg = DrafterConfig(**shape)
    assert cfg.target_layer_ids == [1, 3] and cfg.gamma == 4.0
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown DrafterConfig key num_layers"):
        DrafterConfig.from_dict({**cfg.to_dict(), "num_layers": 2})
    with pytest.raises(ValueError, match=r"^DrafterConfig.target_layer_ids \[6\] are outside"):
        DrafterConfig(**shape, target_layer_ids=[6])
    with pytest.raises(ValueError, match="a target with 6 layers has too few layers"):
        DrafterConfig(**{**shape, "num_hidden_layers": 5})


def test_the_published_recipe_preset_loads():
    """templates/dflash-recipe.yaml: the DFlash paper's recipe, valid as it ships."""
    from dflash.pipeline.train_config import load_train_config as load

    recipe = Path(__file__).resolve().parents[1] / "templates" / "dflash-recipe.yaml"
    cfg = load(recipe)
    assert (cfg.drafter.block_size, cfg.drafter.num_layers, cfg.drafter.gamma) == (16, 5, 7.0)
    assert (cfg.data.num_anchors, cfg.data.seq_len, cfg.optim.lr) == (512, 3072, 6e-4)
    assert cfg.regenerate.output == cfg.data.source and cfg.eval.every > 0
    # One recipe for any target: sized to a time budget, shapes fitted to the data.
    assert cfg.train.budget_minutes and cfg.regenerate.budget_minutes and cfg.data.fit
    assert "arXiv 2602.06036" in recipe.read_text()
