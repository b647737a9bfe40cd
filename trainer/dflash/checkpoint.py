"""Drafter checkpoints in the layout of the published DFlash drafters.

A checkpoint directory holds `model.safetensors` (the drafter's own weights only,
names as in z-lab's `dflash/model.py`: `fc.weight`, `hidden_norm.weight`,
`layers.N....`, `norm.weight`; no embedding, no LM head) and `config.json`
(architectures `DFlashDraftModel`, Qwen3 body, `block_size`, `num_target_layers`,
`dflash_config` with `mask_token_id` and `target_layer_ids`, `auto_map` and
`transformers_version`) and `dflash.py` (the model class for transformers'
AutoModel with trust_remote_code). Files are written to temporary names and
renamed, so a crash never leaves a half-written file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import DrafterConfig
from .model import DFlashDrafter

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
MODELING_FILE = "dflash.py"  # a copy of hf_modeling.py, named as in the published drafters
# Keys a published drafter never carries but a converted one might; they belong to the target.
_TARGET_KEYS = ("embed_tokens.weight", "lm_head.weight")


def _replace_atomically(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_drafter(
    drafter: DFlashDrafter,
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write the drafter to `directory` (created if needed); returns the directory.

    `dtype` casts floating weights (e.g. torch.bfloat16 for serving); `metadata`
    goes into the safetensors header (string values, e.g. step and run id).
    """
    return save_drafter_weights(
        drafter.state_dict(), drafter.cfg, directory, dtype=dtype, metadata=metadata
    )


def save_drafter_weights(
    weights: dict[str, torch.Tensor],
    cfg: DrafterConfig,
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """`save_drafter` from a state dict (e.g. a checkpoint's host snapshot), with the
    modeling file and `auto_map` that let `AutoModel.from_pretrained(directory,
    trust_remote_code=True)` build a `DFlashDraftModel` from it."""
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in weights.items():
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.to("cpu").contiguous()
    saved_dtype = next(iter(tensors.values())).dtype
    config = cfg.to_hf_dict()
    config["dtype"] = str(saved_dtype).removeprefix("torch.")
    config["torch_dtype"] = config["dtype"]  # transformers 4.x reads this name
    config["auto_map"] = {"AutoModel": f"{MODELING_FILE.removesuffix('.py')}.DFlashDraftModel"}
    config["transformers_version"] = transformers.__version__
    header = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
    _replace_atomically(
        directory / WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata=header)
    )
    source = (Path(__file__).with_name("hf_modeling.py")).read_text()
    _replace_atomically(directory / MODELING_FILE, lambda p: p.write_text(source))
    _replace_atomically(
        directory / CONFIG_NAME,
        lambda p: p.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"),
    )
    return directory


def load_drafter_config(directory: str | Path) -> DrafterConfig:
    path = Path(directory) / CONFIG_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: not a drafter checkpoint directory") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    return DrafterConfig.from_hf_dict(data)


def load_drafter(
    directory: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> DFlashDrafter:
    """A drafter from a checkpoint directory (ours or a published one); bind the target after."""
    directory = Path(directory)
    cfg = load_drafter_config(directory)
    weights_path = directory / WEIGHTS_NAME
    if not weights_path.exists():
        raise ValueError(f"{weights_path} does not exist: not a drafter checkpoint directory")
    state = {k: v for k, v in load_file(str(weights_path)).items() if k not in _TARGET_KEYS}
    drafter = DFlashDrafter(cfg)
    expected = set(drafter.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{weights_path} does not match the drafter in {CONFIG_NAME}: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    drafter.load_state_dict(state)
    return drafter.to(device=device, dtype=dtype) if dtype is not None else drafter.to(device)
