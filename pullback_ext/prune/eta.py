"""The prune ratio η a reduction setting produces on a timm ViT, from the schedule and the token
count alone (no forward pass): what every run records next to its FLOPs
(:func:`pullback_ext.prune.cost.count_flops` of the patched forward).

η is the fraction of the model's patch tokens removed by the end of the last block (prefix tokens
never count; EViT's fused token counts as removed; Expedite's ``h·w`` cluster tokens count as
kept). ToMe's, EViT's, PiToMe's and Expedite's counts do not depend on the image. For the
single-stage strategies and ASAP η is the total the stages remove (``ratio`` rounded to whole
tokens; ASAP's pooled ring tokens count as kept); the re-insertion of Last-Layer Fusion before the
last block does not undo it.
"""

from __future__ import annotations

from typing import Optional, Union

from pullback_ext.errors import PullbackError
from pullback_ext.prune import evit, expedite, pitome, timm_vit, tome
from pullback_ext.prune.pipeline import stage_budgets
from pullback_ext.prune.reduction_options import ReductionOptions
from pullback_ext.prune.strategies import ORIGINALS
from pullback_ext.tap.budget import keep_count, tokens_per_block


def patch_tokens_per_block(options: ReductionOptions, model, num_patches: Optional[int] = None) -> list[Union[int, None]]:
    """Patch tokens after each block of the timm ``model`` under ``options`` (``num_patches``: the
    model's patch count at its configured image size unless given). Single-stage strategies: the
    tokens that block processes (with prune-mode LLF the last block runs on all of them again).
    ``tap``: the exact counts before its first and from its last eligible layer on, None between
    them, where the split is per batch (:func:`pullback_ext.tap.budget.tokens_per_block`)."""
    timm_vit.check_model(model)
    shape, n = timm_vit.backbone_shape(model), _num_patches(model, num_patches)
    reduction = options.resolve(shape)
    o = reduction.options
    if o.strategy == "tome":
        return tome.patch_tokens_per_block(o, shape.num_prefix, n, shape.depth)
    if o.strategy == "evit":
        return evit.patch_tokens_per_block(o, n, shape.depth)
    if o.strategy == "pitome":
        return pitome.patch_tokens_per_block(o, n, shape.depth)
    if o.strategy == "expedite":
        return expedite.patch_tokens_per_block(o, n, shape.depth)
    if o.strategy == "tap":
        register = reduction.strategy.register
        return tokens_per_block(register.layers, register.task, 1.0 - o.ratio, n, shape.depth)
    budgets = stage_budgets(reduction, n)
    counts = [n - sum(r for layer, r in budgets.items() if layer <= i) for i in range(shape.depth)]
    if o.mode == "prune" and o.llf and budgets:
        counts[-1] = n
    return counts


def eta(options: ReductionOptions, model, num_patches: Optional[int] = None) -> float:
    """η in [0, 1): the fraction of the ``num_patches`` patch tokens (default: the model's) that
    ``options`` remove on the timm ``model`` (see the module docstring)."""
    timm_vit.check_model(model)
    n = _num_patches(model, num_patches)
    if options.strategy == "tap":  # exactly floor(ρN + 0.5) patch tokens after its last reduction
        return 1.0 - keep_count(1.0 - options.ratio, n) / n
    if options.strategy in ORIGINALS and options.strategy != "asap":  # ASAP: one stage of ratio
        return 1.0 - patch_tokens_per_block(options, model, n)[-1] / n
    return sum(stage_budgets(options.resolve(timm_vit.backbone_shape(model)), n).values()) / n


def _num_patches(model, num_patches: Optional[int]) -> int:
    if num_patches is None:
        return int(model.patch_embed.num_patches)
    if not isinstance(num_patches, int) or isinstance(num_patches, bool) or num_patches < 1:
        raise PullbackError(f"num_patches must be None or an int >= 1; got {num_patches!r}")
    return num_patches
