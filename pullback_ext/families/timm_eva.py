"""timm ``Eva`` (EVA-02, the RoPE ViTs, timm's DINOv3 ports): blocks that rotate queries and keys
by a rotary table of the patch grid (one, or one per block for the "mixed" RoPE), laid out for the
model's own prefix tokens only, so no further prefix token (a task register) fits it."""

from typing import Optional

import torch

from pullback_ext.families.adapter import TimmFamily
from pullback_ext.families.timm_vit import LORA_TARGETS


def rotary_table(model) -> Optional[torch.Tensor]:
    """The rotary table ``model``'s blocks read (``[n, d]``, or ``[depth, H, n, d]`` for the mixed
    RoPE) at its image size; None for a model without RoPE. Call it in eval mode, without gradients."""
    if model.rope is None:
        return None
    param = next(model.parameters())
    size = tuple(int(s) for s in model.patch_embed.img_size)
    _, rope = model._pos_embed(model.patch_embed(param.new_zeros(1, 3, *size)))
    return rope


def _classes() -> tuple:
    from timm.models.eva import Eva

    return (Eva,)


ADAPTER = TimmFamily(
    name="timm_eva", title="a timm Eva", listing="", classes=_classes, lora_targets=LORA_TARGETS,
    priority=0, rotary=True, takes_extra_token=False, rotary_table=rotary_table,
)
