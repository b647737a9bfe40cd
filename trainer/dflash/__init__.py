"""DFlash drafter training: model, objective, target access, evaluation, data, checkpoints.

Typical step (see objective.py for shapes):

    cfg = DrafterConfig.from_target_config(target.config, num_layers=5, block_size=16, mask_token_id=151669)
    drafter = DFlashDrafter(cfg).bind_target(*target_parts(target))
    context = target_context(target, batch.input_ids, batch.attention_mask, cfg.target_layer_ids)
    anchors, valid = sample_anchors(batch.loss_mask, cfg.block_size, num_anchors, generator)
    loss, metrics = drafter_loss(drafter, context, batch.input_ids, anchors, valid, loss_chunk=64,
                                 loss_mask=batch.loss_mask)
"""

from .config import DrafterConfig, default_gamma, select_target_layers
from .model import DFlashDrafter
from .objective import drafter_loss, expected_acceptance_length, sample_anchors
from .target import build_tiny_target, load_target, target_context, target_parts

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
