"""The drafter's configuration and the published rule for picking target layers.

One pydantic model holds everything that shapes the drafter: the Qwen3-style body
(copied from the target, since the drafter shares its embedding and LM head),
the target layers whose hidden states form the context, the block size, the
mask token and the loss decay gamma. `to_hf_dict` writes it in the
`config.json` layout of the published DFlash drafters (architectures
`DFlashDraftModel`, `block_size`, `num_target_layers`, `dflash_config`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

# gamma values of the published recipe, by block size; others interpolate.
PUBLISHED_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def select_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs form the drafter's context, as published.

    Evenly spaced from layer 1 to layer N-3 (rounded); one layer -> N // 2.
    Qwen3-8B (36 layers) with 5 -> [1, 9, 17, 25, 33].
    """
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end - start + 1 < num_draft_layers:
        raise ValueError(
            f"a target with {num_target_layers} layers has too few layers between 1 and "
            f"{end} for {num_draft_layers} distinct context layers"
        )
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def default_gamma(block_size: int) -> float:
    """Loss decay gamma: the published value for B in {8, 10, 16}, else about 0.44 * B."""
    if block_size in PUBLISHED_GAMMA:
        return PUBLISHED_GAMMA[block_size]
    return max(1.0, round(0.44 * block_size, 2))


def _at_least_1(value: int, info: ValidationInfo) -> int:
    if value < 1:
        raise ValueError(f"DrafterConfig.{info.field_name} must be >= 1, got {value}")
    return value


Size = Annotated[int, AfterValidator(_at_least_1)]


class DrafterConfig(BaseModel):
    """Validated on construction; derived values (the context layers, gamma) are worked
    out by validators from the other fields, never by changing the config afterwards.
    Mistakes raise ValueError (``DrafterConfig.<field> ...``)."""

    # Lax types: the values come from transformers configs and config.json files.
    model_config = ConfigDict(extra="forbid", validate_default=True)

    # Body (Qwen3 decoder layers); hidden_size and vocab_size equal the target's.
    hidden_size: Size
    intermediate_size: Size
    num_hidden_layers: Size
    num_attention_heads: Size
    num_key_value_heads: Size
    head_dim: Size
    vocab_size: Size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    # DFlash specifics.
    num_target_layers: Size
    target_layer_ids: list[int] = Field(default_factory=list)  # empty -> the published rule
    block_size: int = 16
    mask_token_id: int
    gamma: float = 0.0  # 0 -> default_gamma(block_size)
    # Copied from the target so a served drafter knows its special tokens.
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:  # one plain sentence, as callers report it
            raise ValueError(_first_message(exc)) from None

    @field_validator("target_layer_ids")
    @classmethod
    def _context_layers(cls, value: list[int], info: ValidationInfo) -> list[int]:
        total = info.data.get("num_target_layers")
        if total is None:
            return value
        if not value:
            return select_target_layers(total, info.data["num_hidden_layers"])
        bad = [i for i in value if not 0 <= i < total]
        if bad:
            raise ValueError(
                f"DrafterConfig.target_layer_ids {bad} are outside the target's {total} layers"
            )
        return value

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, value: int) -> int:
        if value < 2:
            raise ValueError(f"DrafterConfig.block_size must be >= 2, got {value}")
        return value

    @field_validator("gamma")
    @classmethod
    def _gamma(cls, value: float, info: ValidationInfo) -> float:
        if value == 0.0 and "block_size" in info.data:
            return default_gamma(info.data["block_size"])
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"DrafterConfig.gamma must be a positive number, got {value}")
        return value

    @model_validator(mode="after")
    def _fits_together(self) -> DrafterConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DrafterConfig.mask_token_id must be an id in the target vocabulary "
                f"[0, {self.vocab_size}), got {self.mask_token_id}"
            )
        return self

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target_config(
        cls,
        target_cfg: Any,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        gamma: float | None = None,
        *,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
    ) -> DrafterConfig:
        """A drafter shaped like the target (a transformers config or its dict)."""
        get = (
            target_cfg.get
            if isinstance(target_cfg, dict)
            else lambda k, d=None: getattr(target_cfg, k, d)
        )
        num_heads = get("num_attention_heads")
        head_dim = get("head_dim") or get("hidden_size") // num_heads
        return cls(
            hidden_size=get("hidden_size"),
            intermediate_size=intermediate_size or get("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            vocab_size=get("vocab_size"),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(get),
            max_position_embeddings=get("max_position_embeddings", 40960),
            attention_bias=bool(get("attention_bias", False)),
            num_target_layers=get("num_hidden_layers"),
            target_layer_ids=list(target_layer_ids or []),
            block_size=block_size,
            mask_token_id=mask_token_id,
            gamma=gamma or 0.0,
            bos_token_id=get("bos_token_id"),
            eos_token_id=get("eos_token_id"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        )

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        return cls(**data)

    def to_hf_dict(self) -> dict[str, Any]:
        """`config.json` in the layout of the published DFlash drafters (Qwen3 body).

        Serving engines pick the drafter by `architectures`; `auto_map` (remote code for
        transformers' AutoModel) and `transformers_version` are added by
        `checkpoint.save_drafter_weights`, which writes the modeling file beside them.
        """
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "gamma": self.gamma,
                "use_aux_hidden_state": True,
            },
            # vLLM's hidden-state capture counts the embedding as 0: id i + 1 is the output
            # of decoder layer i (older vLLM versions read only this key and size fc by it).
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.target_layer_ids],
            # The method, stated in the folder itself (speculators' layout names it so);
            # a serving engine then needs no "dflash" in the path to know what this is.
            "speculators_config": {
                "algorithm": "dflash",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": self.block_size - 1,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
            },
            "num_speculative_tokens": self.block_size - 1,
            "dtype": "bfloat16",
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "sliding_window": None,
            "use_sliding_window": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        """Read a published-layout `config.json` (ours or z-lab's)."""
        dflash = data.get("dflash_config") or {}

        def pick(name, default=None):
            return dflash.get(name, data.get(name, default))

        if pick("mask_token_id") is None or pick("target_layer_ids") is None:
            raise ValueError(
                "config.json lacks dflash_config.mask_token_id or dflash_config.target_layer_ids"
            )
        num_heads = data["num_attention_heads"]
        return cls(
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=data.get("num_key_value_heads") or num_heads,
            head_dim=data.get("head_dim") or data["hidden_size"] // num_heads,
            vocab_size=data["vocab_size"],
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(data.get),
            max_position_embeddings=data.get("max_position_embeddings", 40960),
            attention_bias=bool(data.get("attention_bias", False)),
            num_target_layers=pick("num_target_layers"),
            target_layer_ids=list(pick("target_layer_ids")),
            block_size=int(pick("block_size", 16)),
            mask_token_id=int(pick("mask_token_id")),
            gamma=float(pick("gamma", 0.0) or 0.0),
            bos_token_id=data.get("bos_token_id"),
            eos_token_id=data.get("eos_token_id"),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        )


def _rope_theta(get) -> float:
    """rope_theta from either transformers 4.x (`rope_theta`) or 5.x (`rope_parameters`)."""
    params = get("rope_parameters") or {}
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    scaling = get("rope_scaling")
    if rope_type != "default" or (
        isinstance(scaling, dict) and scaling.get("rope_type", "default") != "default"
    ):
        raise ValueError(
            f"only default RoPE is supported by the drafter, got rope_type {rope_type!r}"
        )
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or get("rope_theta") or 10000.0)


def _first_message(exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    if error["type"] == "value_error":
        return str(error["ctx"]["error"])
    where = ".".join(str(p) for p in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown DrafterConfig key {where}; allowed: {sorted(DrafterConfig.model_fields)}"
    return f"DrafterConfig.{where}: {error['msg']}, got {error['input']!r}"
