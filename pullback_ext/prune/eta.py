"""The prune ratio η a reduction setting produces on a timm ViT, from the schedule and the token
count alone (no forward pass): what every run records next to its FLOPs.

η is the fraction of the model's patch tokens removed by the end of the last block (prefix tokens
never count); each method counts its own (:meth:`~pullback_ext.prune.methods.base.Method.eta`):
EViT's fused token counts as removed, Expedite's ``h·w`` cluster tokens and ASAP's pooled ring
tokens as kept; for the single-stage strategies η is the total the stages remove (``ratio``
rounded to whole tokens), which the re-insertion of Last-Layer Fusion does not undo.
"""

from __future__ import annotations

from typing import Optional, Union

from pullback_ext.errors import PullbackError
from pullback_ext.prune import timm_vit
from pullback_ext.prune.reduction_options import ReductionOptions


def patch_tokens_per_block(options: ReductionOptions, model, num_patches: Optional[int] = None) -> list[Union[int, None]]:
    """Patch tokens after each block of the timm ``model`` under ``options`` (``num_patches``: the
    model's patch count at its configured image size unless given); None where the count depends
    on the batch (TAP between its first and last eligible layer)."""
    timm_vit.check_model(model)
    reduction = options.resolve(timm_vit.backbone_shape(model))
    return reduction.method.patch_tokens_per_block(reduction, _num_patches(model, num_patches))


def eta(options: ReductionOptions, model, num_patches: Optional[int] = None) -> float:
    """η in [0, 1): the fraction of the ``num_patches`` patch tokens (default: the model's) that
    ``options`` remove on the timm ``model`` (see the module docstring)."""
    timm_vit.check_model(model)
    reduction = options.resolve(timm_vit.backbone_shape(model))
    return reduction.method.eta(reduction, _num_patches(model, num_patches))


def _num_patches(model, num_patches: Optional[int]) -> int:
    if num_patches is None:
        return int(model.patch_embed.num_patches)
    if not isinstance(num_patches, int) or isinstance(num_patches, bool) or num_patches < 1:
        raise PullbackError(f"num_patches must be None or an int >= 1; got {num_patches!r}")
    return num_patches
