"""DFlash drafter training: model, objective, target access, evaluation, data, checkpoints.

Typical step (see objective.py for shapes):

    cfg = DrafterConfig.from_target_config(target.config, num_layers=5, block_size=16, mask_token_id=151669)
    drafter = DFlashDrafter(cfg).bind_target(*target_parts(target))
    context = target_context(target, batch.input_ids, batch.attention_mask, cfg.target_layer_ids)
    anchors, valid = sample_anchors(batch.loss_mask, cfg.block_size, num_anchors, generator)
    loss, metrics = drafter_loss(drafter, context, batch.input_ids, anchors, valid, loss_chunk=64,
                                 loss_mask=batch.loss_mask)
"""

import importlib

# Imported on first use (PEP 562): reading the trainer config (dflash.pipeline.train_config)
# must not import torch, so that checking a config takes a fraction of a second.
_HOMES = {
    "DrafterConfig": ".config",
    "default_gamma": ".config",
    "select_target_layers": ".config",
    "DFlashDrafter": ".model",
    "drafter_loss": ".objective",
    "expected_acceptance_length": ".objective",
    "sample_anchors": ".objective",
    "build_tiny_target": ".target",
    "load_target": ".target",
    "target_context": ".target",
    "target_parts": ".target",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name], __name__), name)


__all__ = [
    "DFlashDrafter",
    "DrafterConfig",
    "build_tiny_target",
    "default_gamma",
    "drafter_loss",
    "expected_acceptance_length",
    "load_target",
    "sample_anchors",
    "select_target_layers",
    "target_context",
    "target_parts",
]
