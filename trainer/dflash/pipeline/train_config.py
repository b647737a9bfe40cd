"""The trainer's configuration: typed sections (pydantic) loaded from YAML plus ``--set``.

Every key is checked before anything is built: an unknown key, a wrong type, a value
outside its allowed set or two values that do not fit together raise
``TrainConfigError`` naming the file (with the line and column) or the ``--set``, and
the dotted key path. ``--set`` values are read as YAML, so they are typed like the
file's. Derived values (``runtime.compile: auto``) are worked out by validators that
return the value to keep; nothing changes a loaded config afterwards.

Types are strict (``steps: "5"`` is not an integer) with three harmless exceptions kept
from the YAML reading: a number may be written as text (YAML 1.1 reads ``1e-3`` as a
string), a number where text is expected becomes text, and a single value where a list
is expected is a list of one (``--set runtime.drafter_devices=cuda:0``).
Declare one field per line.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dflash.pipeline.config_errors import (
    TrainConfigError,
    first_mistake,
    invalid,
    load_yaml_with_marks,
)

# The drafter's attention implementations (dflash/masks.py has one for each); named here,
# in the config's vocabulary, so that reading a config needs no model code.
ATTENTION_BACKENDS = ("sdpa_dense", "sdpa_chunked", "flex")

__all__ = ["TrainConfig", "TrainConfigError", "load_train_config", "config_from_dict"]

COMPILE_MODES = ("eager", "default", "reduce-overhead", "legacy-cudagraphs")
SCHEDULES = ("pipelined", "sequential")
COMM_DTYPES = ("float32", "bfloat16")
DTYPES = ("float32", "bfloat16", "float16")
PRESETS = ("tiny", "small", "qwen3-8b")


# ---------------------------------------------------------------- value types


def _number_from_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _text_from_number(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


def _list_of_one(value: Any) -> Any:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return [value]
    return value


def _at_least(low: int):
    def check(value: int) -> int:
        if value < low:
            raise invalid(
                f"must be at least 1, got {value}"
                if low == 1
                else f"must be 0 or more, got {value}"
            )
        return value

    return AfterValidator(check)


def _above_zero(value: float) -> float:
    if value <= 0:
        raise invalid(f"must be above 0, got {value}")
    return value


def _one_of(*allowed: str):
    def check(value: str) -> str:
        if value not in allowed:
            raise invalid(f"{value!r} is not one of {', '.join(allowed)}")
        return value

    return AfterValidator(check)


def _devices(value: list[str]) -> list[str]:
    if not value:
        raise invalid("must name a device, e.g. [cpu] or [cuda:0]")
    for dev in value:
        if dev != "cpu" and not (dev.startswith("cuda:") and dev[5:].isdigit()):
            raise invalid(f"{dev!r} is not 'cpu' or 'cuda:N'")
    return value


Number = Annotated[float, BeforeValidator(_number_from_text)]
Text = Annotated[str, BeforeValidator(_text_from_number)]
Count = Annotated[int, _at_least(1)]  # 1 or more
Amount = Annotated[int, _at_least(0)]  # 0 or more
IntList = Annotated[list[int], BeforeValidator(_list_of_one)]
Devices = Annotated[list[Text], BeforeValidator(_list_of_one), AfterValidator(_devices)]
Dtype = Annotated[Text, _one_of(*DTYPES)]


def _true_false_or_auto(value: Any) -> Any:
    if isinstance(value, bool) or value == "auto":
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise invalid(f"must be true, false or auto, got {value!r}")


TriState = Annotated[bool | str, BeforeValidator(_true_false_or_auto)]


class Section(BaseModel):
    # Defaults go through the validators too (runtime.compile: auto is resolved).
    model_config = ConfigDict(strict=True, extra="forbid", validate_default=True)


# ---------------------------------------------------------------- sections


class TargetSection(Section):
    preset: Annotated[Text, _one_of(*PRESETS)] = "tiny"  # random shape when path is empty
    path: Text | None = None  # local Hugging Face checkpoint folder; empty -> random weights
    dtype: Dtype = "float32"
    seed: int = 0  # seed of the random target (and of its synthetic data)
    init_std: Number = 0.02  # weight init of the random target (larger: sharper logits)
    # The training forward on GPUs. fused: Llama-shaped targets (llama, qwen2, qwen3) run
    # their layers written out (context_decoder.py: one q/k/v and one gate/up matmul, SDPA's
    # causal kernel), checked against transformers' forward at the first call. compile:
    # torch.compile with static shapes; auto compiles the written-out forward only, and
    # only where the drafter compiles (runtime.compile not eager). On an H100 at the 8B
    # shape: 52.7% MFU against 45.0% eager; transformers' forward compiled was 0.93x. fp8: FP8 matmuls in its decoder layers (evaluation and the
    # drafter's embedding/LM head stay as loaded).
    compile: TriState = "auto"
    fp8: bool = False
    fused: bool = True


class DrafterSection(Section):
    num_layers: Count = 2
    block_size: Count = 4
    gamma: Number = 0.0  # 0 -> the published value for the block size
    intermediate_size: Count | None = None  # None -> the target's
    dtype: Dtype = "float32"  # model weights; the optimizer keeps an fp32 master copy
    # sdpa_dense (the reference) | sdpa_chunked (same result, skips context no block
    # of a chunk can see: the fast one on GPU) | flex (GPU)
    attention: Annotated[Text, _one_of(*ATTENTION_BACKENDS)] = "sdpa_dense"
    attention_chunk: Count = 32  # sdpa_chunked: anchors per chunk
    mask_token_id: Amount | None = None  # None -> the tokenizer's <|MASK|>, else the last id

    @field_validator("gamma")
    @classmethod
    def _gamma(cls, value: float) -> float:
        if not value >= 0:
            raise invalid(
                f"must be 0 (the published value for the block size) or more, got {value}"
            )
        return value


class DataSection(Section):
    # synthetic (the target continues random prompts) | random | a .jsonl/.txt path
    source: Text = "synthetic"
    tokenizer: Text | None = None  # local tokenizer folder; None -> target.path, else built-in tiny
    num_samples: Count = 256  # synthetic/random: how many sequences
    seq_len: Count = 64  # every batch is padded/truncated to exactly this length
    batch_size: Count = 4  # sequences per drafter per step
    num_anchors: Count = 8  # anchors per sequence
    prompt_len: Count = 8  # synthetic: random prompt length before the target continues
    # File data: seq_len (then a ceiling) and num_anchors fitted to it (dflash/budget.py).
    fit: bool = False


class OptimSection(Section):
    lr: Number = 6e-4
    warmup_ratio: Number = 0.04
    min_lr_ratio: Number = 0.0
    weight_decay: Number = 0.0
    beta1: Number = 0.9
    beta2: Number = 0.95
    eps: Number = 1e-8
    grad_clip: Number = 1.0

    @field_validator("warmup_ratio")
    @classmethod
    def _warmup_ratio(cls, value: float) -> float:
        if not 0 <= value < 1:
            raise invalid(f"must be in [0, 1), got {value}")
        return value


class TrainSection(Section):
    steps: Count = 100
    # Passes over the training samples instead of a step count: when set, the run takes
    # ceil(epochs * samples / samples per step) steps and train.steps is not used.
    epochs: Annotated[Number, AfterValidator(_above_zero)] | None = None
    # A wall-clock budget instead: steps timed by a probe, as many as fit (dflash/budget.py);
    # train.steps and train.epochs are then not used.
    budget_minutes: Annotated[Number, AfterValidator(_above_zero)] | None = None
    log_every: Count = 10
    # tau~ on each step line is estimated from the step's own anchors (free); the exact
    # serving walk over this many rows of a batch (metrics.jsonl tau_walk) runs on logged
    # steps while it takes at most tau_walk_budget of the training time; 0: never.
    tau_walk_rows: Amount = 4
    tau_walk_budget: Number = 0.01  # share of the training time
    # Data-file samples kept from training for the walk: > 0, it walks them instead of the
    # batch (held-out tau, which memorising the data cannot raise: what serving will see);
    # 0: the batch about to be trained on (unseen only in the first epoch).
    tau_walk_heldout: Amount = 0
    # true: walk the eval prompts instead, answered once by the target before training
    # (greedy, eval.max_new_tokens): the walk's tau is what the eval will measure.
    tau_walk_eval: bool = False
    checkpoint_every: Amount = 0  # 0 -> only at the end (and on SIGTERM)
    final_checkpoint: bool = True  # false: benchmarks skip writing the end-of-run checkpoint
    max_nonfinite: Amount = 3  # stop after more than this many non-finite losses
    loss_chunk: Amount = 0  # rows per loss chunk; 0 -> the objective's default
    export_dtype: Dtype = "bfloat16"  # checkpoint drafter/ export; resume state stays fp32


class RuntimeSection(Section):
    target_devices: Devices = Field(default_factory=lambda: ["cpu"])
    drafter_devices: Devices = Field(default_factory=lambda: ["cpu"])
    # auto | eager | default | reduce-overhead | legacy-cudagraphs; auto: reduce-overhead
    # (CUDA Graph Trees) when the drafters are on GPUs, eager on CPU
    compile: Text = "auto"
    schedule: Annotated[Text, _one_of(*SCHEDULES)] = "pipelined"
    queue_size: Count = 8  # hidden-state batches buffered per drafter
    warmup_iters: Amount = 3  # compiled warm-up iterations (warm-up, record, replay)
    peak_tflops: Number = 0.0  # per device, for mfu; 0 -> known GPU table or none
    threads: Amount = 0  # torch intra-op threads; 0 -> leave torch's default
    grad_comm_dtype: Annotated[Text, _one_of(*COMM_DTYPES)] = "float32"  # all-reduce precision
    dist_backend: Annotated[Text, _one_of("auto", "nccl", "gloo")] = (
        "auto"  # torchrun; auto: nccl on GPUs
    )
    grad_bucket_mb: Annotated[Number, AfterValidator(_above_zero)] = (
        256.0  # torchrun all-reduce buckets
    )
    dist_timeout_s: Annotated[Number, AfterValidator(_above_zero)] = (
        120.0  # torchrun: a hung collective
    )
    peer_timeout_s: Annotated[Number, AfterValidator(_above_zero)] = (
        15.0  # torchrun: silent rank is dead
    )

    @field_validator("compile")
    @classmethod
    def _compile_mode(cls, value: str, info: ValidationInfo) -> str:
        if value == "auto":  # the mode to use, decided once here
            on_gpu = any(d.startswith("cuda") for d in info.data.get("drafter_devices", []))
            return "reduce-overhead" if on_gpu else "eager"
        if value not in COMPILE_MODES:
            raise invalid(f"{value!r} is not one of {', '.join(COMPILE_MODES)}")
        return value


class EvalSection(Section):
    enabled: bool = True
    num_prompts: Count = 4
    max_new_tokens: Count = 64
    holdout: Amount | None = None  # data-file samples kept from training; None: num_prompts
    source: Text | None = None  # .jsonl/.txt of eval prompts instead of held-out samples
    prompt_tokens: Count = 32  # plain text: prompt with a document's first tokens (<= half)
    # Also evaluate every this many steps during training (0: only at the end). Drafter-0
    # pauses for it; under torchrun the other ranks wait in the next all-reduce, so one
    # eval must take less than runtime.dist_timeout_s (fewer/shorter prompts, or raise it).
    every: Amount = 0
    # Prompts decoded together (padded, one forward for all); 1: one prompt at a time.
    # Either way the same tokens in float32; batches make eval.every cheap.
    batch_size: Count = 16


class RegenerateSection(Section):
    """python -m dflash.regenerate: the target answers the prompts of a chat JSONL."""

    input: Text | None = None  # chat JSONL whose prompts (messages before the last answer) are used
    output: Text | None = None  # chat JSONL to write (appended; the trainer's data.source)
    max_new_tokens: Count = 1024
    batch_size: Count = 32  # prompts per generate call on one device
    sample: bool | None = None  # None: the target's generation_config (do_sample)
    temperature: Number | None = None  # None: the generation config's
    top_p: Number | None = None
    top_k: Amount | None = None
    seed: int | None = 0  # sampling seed (plus the rank)
    answers_per_prompt: Count = 1  # the first as above, the rest sampled (dflash.regenerate)
    device: Text | None = None  # None: cuda:LOCAL_RANK when there is a GPU, else cpu
    template_kwargs: dict[str, Any] = Field(default_factory=dict)  # e.g. {enable_thinking: false}
    budget_minutes: Annotated[Number, AfterValidator(_above_zero)] | None = None  # then stop


def _tracker_switch(value: Any) -> Any:
    """`wandb: true` is the tracker with its defaults; `false` or nothing, no tracker."""
    if value is True:
        return {}
    if value is False:
        return None
    return value


def _tracker_installed(package: str, setting: str, extra: str):
    def check(value: Any) -> Any:
        if value is not None and importlib.util.find_spec(package) is None:
            from dflash.pipeline.trackers import missing_package

            # Named as written: `wandb: true`, or the first of its settings (wandb.mode).
            written = sorted(value.model_fields_set)
            shown = f"{getattr(value, written[0])}" if written else "true"
            raise invalid(
                missing_package(package, setting, extra, shown),
                key=tuple(written[:1]),
            )
        return value

    return AfterValidator(check)


class WandbSection(Section):
    project: Text = "dflash"
    entity: Text | None = None
    name: Text | None = None  # None: the run folder's name (dflashctl's run id)
    # online | offline (files under the run folder's wandb/, `wandb sync` them later) |
    # disabled; None: WANDB_MODE, else online
    mode: Annotated[Text, _one_of("online", "offline", "disabled")] | None = None


class MlflowSection(Section):
    # None: MLFLOW_TRACKING_URI, else a file store in the run folder (file:.../mlruns)
    tracking_uri: Text | None = None
    experiment: Text = "dflash"
    run_name: Text | None = None  # None: the run folder's name (dflashctl's run id)

    @field_validator("tracking_uri")
    @classmethod
    def _from_environment(cls, value: str | None) -> str | None:
        return value or os.environ.get("MLFLOW_TRACKING_URI") or None


class LoggingSection(Section):
    # TensorBoard event files next to metrics.jsonl (`tensorboard --logdir runs/`);
    # needs the tensorboard package (in the trainer extra)
    tensorboard: bool = False
    # Weights & Biases (`true` or its settings); needs the wandb package (wandb extra)
    wandb: Annotated[
        WandbSection | None,
        BeforeValidator(_tracker_switch),
        _tracker_installed("wandb", "logging.wandb", "wandb"),
    ] = None
    # MLflow (`true` or its settings); needs the mlflow package (mlflow extra)
    mlflow: Annotated[
        MlflowSection | None,
        BeforeValidator(_tracker_switch),
        _tracker_installed("mlflow", "logging.mlflow", "mlflow"),
    ] = None

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_installed(cls, value: bool) -> bool:
        if value and importlib.util.find_spec("tensorboard") is None:
            raise invalid(
                "true needs the tensorboard package, which is not installed: pip install "
                "tensorboard (it comes with dflashctl's trainer extra), or set it to false "
                "(metrics.jsonl is written either way)"
            )
        return value


class DebugSection(Section):
    tls_fix: bool = True  # False reproduces the CUDA Graph Trees AssertionError on torch <= 2.12
    fail_in: Text | None = None  # "<thread>@start" | "drafter-N@warmup" | "<thread>@step:N"
    # How the failure at fail_in looks: "exception" (a Python exception in that thread)
    # or "sigkill" (the process killed, as the kernel's OOM killer does: retryable).
    fail_kind: Annotated[Text, _one_of("exception", "sigkill")] = "exception"
    # A file: the failure fires only while it does not exist, and creates it (so a
    # restarted run gets past it: automatic recovery tests and demos).
    fail_once_marker: Text | None = None
    # "<thread>@step:N" (or @start, drafter-N@warmup): that thread deadlocks there for
    # good (hang detection and `dflashctl stacks` tests, demos).
    hang_in: Text | None = None
    stop_at_step: Amount = 0  # act as if SIGTERM arrived after this step (tests, demos)
    # After this step, train no further until SIGTERM (tests: redeploy at a known step).
    hold_at_step: Amount = 0
    # The drafters wait at the end of their warm-up until SIGTERM (tests: stop a run
    # before its first step).
    hold_in_warmup: bool = False
    # torchrun: fail_in, hold_at_step and tls_fix=false only on these ranks
    on_ranks: IntList = Field(default_factory=list)
    nonfinite_at_steps: IntList = Field(default_factory=list)  # poison the loss at these steps
    profile_steps: IntList = Field(default_factory=list)  # [first, last]: count CUDA graph launches

    @field_validator("fail_in", "hang_in")
    @classmethod
    def _fail_in(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_fail_in(value)
            except TrainConfigError as exc:
                raise invalid(str(exc).split(": ", 1)[-1]) from None
        return value


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, Section)


class TrainConfig(Section):
    seed: int = 0
    output_dir: Text | None = None  # None -> $DFLASH_RUN_DIR/outputs, else ./outputs
    target: TargetSection = Field(default_factory=TargetSection)
    drafter: DrafterSection = Field(default_factory=DrafterSection)
    data: DataSection = Field(default_factory=DataSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    train: TrainSection = Field(default_factory=TrainSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    regenerate: RegenerateSection = Field(default_factory=RegenerateSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    debug: DebugSection = Field(default_factory=DebugSection)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def resolved_output_dir(self) -> Path:
        if self.output_dir:
            return Path(self.output_dir)
        run_dir = os.environ.get("DFLASH_RUN_DIR")
        return Path(run_dir) / "outputs" if run_dir else Path("outputs")

    @model_validator(mode="before")
    @classmethod
    def _empty_sections_take_the_defaults(cls, data: Any) -> Any:
        """``train:`` with nothing under it (YAML null) is an empty section."""
        if not isinstance(data, dict):
            return data
        sections = [name for name, f in cls.model_fields.items() if _is_section(f.annotation)]
        return {k: {} if v is None and k in sections else v for k, v in data.items()}

    @model_validator(mode="after")
    def _sections_fit_together(self) -> TrainConfig:
        """Checks across sections, all before anything is built."""
        block, seq_len = self.drafter.block_size, self.data.seq_len
        if seq_len < 2 * block:
            raise invalid(
                f"must be at least twice drafter.block_size ({block}), got {seq_len}",
                key=("data", "seq_len"),
            )
        if self.data.source == "synthetic" and seq_len - self.data.prompt_len < 2 * block:
            raise invalid(
                f"{self.data.prompt_len} leaves {seq_len - self.data.prompt_len} of "
                f"data.seq_len ({seq_len}) for the response; synthetic data needs at least "
                f"2 blocks (2 x drafter.block_size = {2 * block})",
                key=("data", "prompt_len"),
            )
        gpus = [dev for dev in self.runtime.drafter_devices if dev.startswith("cuda")]
        if len(set(gpus)) == len(gpus):  # one drafter per GPU: nothing to share a graph
            return self
        # Imported here: the warm-up module brings torch and the thread supervisor with it
        # (reading a config, e.g. dflashctl's check before a deploy stops anything, does not).
        from dflash.pipeline.warmup import check_device_layout

        try:
            check_device_layout(self.runtime.drafter_devices, self.runtime.compile)
        except TrainConfigError as exc:
            raise invalid(
                str(exc).removeprefix("runtime.drafter_devices: "),
                key=("runtime", "drafter_devices"),
            ) from None
        return self


@dataclass(frozen=True)
class FailurePoint:
    thread: str
    stage: str  # start | warmup | step
    step: int = 0


def parse_fail_in(text: str, key: str = "debug.fail_in") -> FailurePoint:
    """``drafter-0@warmup``, ``prefetcher@step:3``, ``target-0@start``."""
    thread, sep, where = text.partition("@")
    if not sep or not thread:
        raise TrainConfigError(
            f"{key}: {text!r} must look like 'drafter-0@warmup' or 'drafter-0@step:5'"
        )
    if where in ("start", "warmup"):
        return FailurePoint(thread, where)
    stage, _, number = where.partition(":")
    if stage == "step" and number.isdigit():
        return FailurePoint(thread, "step", int(number))
    raise TrainConfigError(f"{key}: stage {where!r} must be start, warmup or step:N")


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
    """The config at ``path`` (None: the defaults) with ``overrides`` applied, validated."""
    data: Any = {}
    places: dict = {}
    source = "the defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise TrainConfigError(f"cannot read config {path}: {exc.strerror}") from None
        try:
            data, places = load_yaml_with_marks(text)
        except yaml.YAMLError as exc:
            raise TrainConfigError(f"{path}: not valid YAML: {exc}") from None
        data = data or {}
        if not isinstance(data, dict):
            raise TrainConfigError(f"{path}: the top level must be a mapping")
    set_by: dict[tuple[str, ...], str] = {}
    try:
        for text in overrides:
            key_path, value = parse_override(text)
            _apply_override(data, key_path, value)
            set_by[tuple(key_path)] = text
    except TrainConfigError as exc:
        raise TrainConfigError(f"{source}: {exc}") from None
    return _validated(data, source, places, set_by)


def config_from_dict(data: dict, source: str = "config") -> TrainConfig:
    return _validated(data, source, {}, {})


def _validated(data: dict, source: str, places: dict, set_by: dict) -> TrainConfig:
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        loc, sentence = first_mistake(exc, TrainConfig)
    # The --set that gave the value, or the section it created (``--set trian.steps=3``).
    override = next(
        (text for key, text in set_by.items() if key[: len(loc)] == loc or loc[: len(key)] == key),
        None,
    )
    if override is not None:
        where = f"{source}, --set {override}"
    elif loc in places:
        where = f"{source}, {places[loc]}"
    else:
        where = source
    raise TrainConfigError(f"{where}: {sentence}")


def steps_for_epochs(epochs: float, num_samples: int, samples_per_step: int) -> int:
    """train.epochs as a step count: enough steps that every sample is seen `epochs` times."""
    if num_samples < 1:
        raise TrainConfigError("train.epochs: the data has no training samples to count epochs by")
    return max(1, math.ceil(epochs * num_samples / samples_per_step))
