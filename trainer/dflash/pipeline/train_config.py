"""The trainer's configuration: typed sections loaded from YAML plus ``--set`` overrides.

Every key is checked: an unknown key, a wrong type or a value outside its allowed set
raises ``TrainConfigError`` naming the file and the dotted key path.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflash.masks import ATTENTION_BACKENDS

COMPILE_MODES = ("eager", "default", "reduce-overhead", "legacy-cudagraphs")
SCHEDULES = ("pipelined", "sequential")
DTYPES = ("float32", "bfloat16", "float16")


class TrainConfigError(ValueError):
    """A user mistake in the trainer config or its overrides."""


@dataclass(kw_only=True)
class TargetSection:
    preset: str = "tiny"  # built-in random shape when path is empty: tiny | small | qwen3-8b
    path: str | None = None  # local Hugging Face checkpoint folder; empty -> random weights
    dtype: str = "float32"
    seed: int = 0  # seed of the random target (and of its synthetic data)
    init_std: float = 0.02  # weight init of the random target (larger: sharper logits)


@dataclass(kw_only=True)
class DrafterSection:
    num_layers: int = 2
    block_size: int = 4
    gamma: float = 0.0  # 0 -> the published value for the block size
    intermediate_size: int | None = None  # None -> the target's
    dtype: str = "float32"  # model weights; the optimizer keeps an fp32 master copy
    # sdpa_dense (the reference) | sdpa_chunked (same result, skips context no block
    # of a chunk can see: the fast one on GPU) | flex (GPU)
    attention: str = "sdpa_dense"
    attention_chunk: int = 32  # sdpa_chunked: anchors per chunk
    mask_token_id: int | None = None  # None -> the tokenizer's <|MASK|>, else the last id


@dataclass(kw_only=True)
class DataSection:
    source: str = (
        "synthetic"  # synthetic (the target continues random prompts) | random | a .jsonl/.txt path
    )
    tokenizer: str | None = (
        None  # local tokenizer folder; None -> target.path, else the built-in tiny one
    )
    num_samples: int = 256  # synthetic/random: how many sequences
    seq_len: int = 64  # every batch is padded/truncated to exactly this length
    batch_size: int = 4  # sequences per drafter per step
    num_anchors: int = 8  # anchors per sequence
    prompt_len: int = 8  # synthetic: random prompt length before the target continues


@dataclass(kw_only=True)
class OptimSection:
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass(kw_only=True)
class TrainSection:
    steps: int = 100
    log_every: int = 10
    checkpoint_every: int = 0  # 0 -> only at the end (and on SIGTERM)
    final_checkpoint: bool = True  # false: benchmarks skip writing the end-of-run checkpoint
    max_nonfinite: int = 3  # stop after more than this many non-finite losses
    loss_chunk: int = 0  # rows per loss chunk; 0 -> the objective's default


@dataclass(kw_only=True)
class RuntimeSection:
    target_devices: list[str] = field(default_factory=lambda: ["cpu"])
    drafter_devices: list[str] = field(default_factory=lambda: ["cpu"])
    # auto | eager | default | reduce-overhead | legacy-cudagraphs; auto: reduce-overhead
    # (CUDA Graph Trees) when the drafters are on GPUs, eager on CPU
    compile: str = "auto"
    schedule: str = "pipelined"  # pipelined | sequential
    queue_size: int = 8  # hidden-state batches buffered per drafter
    warmup_iters: int = 3  # compiled warm-up iterations (warm-up, record, replay)
    peak_tflops: float = 0.0  # per device, for mfu; 0 -> known GPU table or none
    threads: int = 0  # torch intra-op threads; 0 -> leave torch's default


@dataclass(kw_only=True)
class EvalSection:
    enabled: bool = True
    num_prompts: int = 4
    max_new_tokens: int = 64


@dataclass(kw_only=True)
class DebugSection:
    tls_fix: bool = True  # False reproduces the CUDA Graph Trees AssertionError on torch <= 2.12
    fail_in: str | None = None  # "<thread>@start" | "drafter-N@warmup" | "<thread>@step:N"
    # How the failure at fail_in looks: "exception" (a Python exception in that thread)
    # or "sigkill" (the process killed, as the kernel's OOM killer does: retryable).
    fail_kind: str = "exception"
    # A file: the failure fires only while it does not exist, and creates it (so a
    # restarted run gets past it: automatic recovery tests and demos).
    fail_once_marker: str | None = None
    stop_at_step: int = 0  # act as if SIGTERM arrived after this step (tests, demos)
    nonfinite_at_steps: list[int] = field(default_factory=list)  # poison the loss at these steps
    profile_steps: list[int] = field(
        default_factory=list
    )  # [first, last]: count CUDA graph launches


@dataclass(kw_only=True)
class TrainConfig:
    seed: int = 0
    output_dir: str | None = None  # None -> $DFLASH_RUN_DIR/outputs, else ./outputs
    target: TargetSection = field(default_factory=TargetSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    eval: EvalSection = field(default_factory=EvalSection)
    debug: DebugSection = field(default_factory=DebugSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolved_output_dir(self) -> Path:
        if self.output_dir:
            return Path(self.output_dir)
        run_dir = os.environ.get("DFLASH_RUN_DIR")
        return Path(run_dir) / "outputs" if run_dir else Path("outputs")


# ---------------------------------------------------------------- building from data


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except TrainConfigError as exc:
                errors.append(str(exc))
        raise TrainConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list):
            raise TrainConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TrainConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TrainConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise TrainConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise TrainConfigError(f"{where}: expected a string, got {value!r}")
    raise TrainConfigError(f"{where}: unsupported type {tp!r}")


def _build(cls: type, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TrainConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        prefix = f"{where}." if where else ""
        raise TrainConfigError(
            f"unknown key {prefix}{unknown[0]}; allowed under {where or 'the top level'}: "
            + ", ".join(names)
        )
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        key = f"{where}.{name}" if where else name
        tp = hints[name]
        kwargs[name] = (
            _build(tp, data[name], key) if _is_section(tp) else _coerce(data[name], tp, key)
        )
    return cls(**kwargs)


def _check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise TrainConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


def validate(cfg: TrainConfig) -> None:
    if cfg.runtime.compile == "auto":
        on_gpu = any(dev.startswith("cuda") for dev in cfg.runtime.drafter_devices)
        cfg.runtime.compile = "reduce-overhead" if on_gpu else "eager"
    _check_choice("runtime.compile", cfg.runtime.compile, COMPILE_MODES)
    _check_choice("runtime.schedule", cfg.runtime.schedule, SCHEDULES)
    _check_choice("target.dtype", cfg.target.dtype, DTYPES)
    _check_choice("drafter.dtype", cfg.drafter.dtype, DTYPES)
    _check_choice("drafter.attention", cfg.drafter.attention, ATTENTION_BACKENDS)
    _check_choice("target.preset", cfg.target.preset, ("tiny", "small", "qwen3-8b"))
    positive = {
        "train.steps": cfg.train.steps,
        "train.log_every": cfg.train.log_every,
        "data.seq_len": cfg.data.seq_len,
        "data.batch_size": cfg.data.batch_size,
        "data.num_anchors": cfg.data.num_anchors,
        "runtime.queue_size": cfg.runtime.queue_size,
        "drafter.attention_chunk": cfg.drafter.attention_chunk,
        "drafter.num_layers": cfg.drafter.num_layers,
        "drafter.block_size": cfg.drafter.block_size,
    }
    for key, value in positive.items():
        if value < 1:
            raise TrainConfigError(f"{key}: must be at least 1, got {value}")
    if (
        cfg.runtime.warmup_iters < 0
        or cfg.train.max_nonfinite < 0
        or cfg.train.checkpoint_every < 0
    ):
        raise TrainConfigError(
            "runtime.warmup_iters, train.max_nonfinite and train.checkpoint_every must be >= 0"
        )
    if not cfg.runtime.target_devices or not cfg.runtime.drafter_devices:
        raise TrainConfigError(
            "runtime.target_devices and runtime.drafter_devices must each name a device"
        )
    for key in ("target_devices", "drafter_devices"):
        for dev in getattr(cfg.runtime, key):
            if dev != "cpu" and not (dev.startswith("cuda:") and dev[5:].isdigit()):
                raise TrainConfigError(f"runtime.{key}: {dev!r} is not 'cpu' or 'cuda:N'")
    if not 0 <= cfg.optim.warmup_ratio < 1:
        raise TrainConfigError(
            f"optim.warmup_ratio: must be in [0, 1), got {cfg.optim.warmup_ratio}"
        )
    if cfg.data.seq_len < 2 * cfg.drafter.block_size:
        raise TrainConfigError(
            f"data.seq_len ({cfg.data.seq_len}) must be at least twice drafter.block_size "
            f"({cfg.drafter.block_size})"
        )
    if cfg.debug.fail_in is not None:
        parse_fail_in(cfg.debug.fail_in)
    if cfg.debug.fail_kind not in ("exception", "sigkill"):
        raise TrainConfigError(
            f"debug.fail_kind: {cfg.debug.fail_kind!r} must be 'exception' or 'sigkill'"
        )


@dataclass(frozen=True)
class FailurePoint:
    thread: str
    stage: str  # start | warmup | step
    step: int = 0


def parse_fail_in(text: str) -> FailurePoint:
    """``drafter-0@warmup``, ``prefetcher@step:3``, ``target-0@start``."""
    thread, sep, where = text.partition("@")
    if not sep or not thread:
        raise TrainConfigError(
            f"debug.fail_in: {text!r} must look like 'drafter-0@warmup' or 'drafter-0@step:5'"
        )
    if where in ("start", "warmup"):
        return FailurePoint(thread, where)
    stage, _, number = where.partition(":")
    if stage == "step" and number.isdigit():
        return FailurePoint(thread, "step", int(number))
    raise TrainConfigError(f"debug.fail_in: stage {where!r} must be start, warmup or step:N")


# ---------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise TrainConfigError(f"--set {text!r}: expected key=value, e.g. train.steps=200")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def _apply_override(data: dict, path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise TrainConfigError(f"--set {'.'.join(path)}: {part} is not a section")
        node = child
    node[path[-1]] = value


def load_train_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    data: dict = {}
    source = "the defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise TrainConfigError(f"cannot read config {path}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise TrainConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise TrainConfigError(f"{path}: the top level must be a mapping")
    try:
        for text in overrides:
            key_path, value = parse_override(text)
            _apply_override(data, key_path, value)
        cfg = _build(TrainConfig, data, "")
        validate(cfg)
    except TrainConfigError as exc:
        raise TrainConfigError(f"{source}: {exc}") from None
    return cfg


def config_from_dict(data: dict) -> TrainConfig:
    cfg = _build(TrainConfig, data, "")
    validate(cfg)
    return cfg
