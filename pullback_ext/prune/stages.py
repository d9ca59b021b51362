"""The token counts of a staged reduction: how many patch tokens each stage of ``layers`` removes
(``ratio`` split over the stages) and how many each block then processes. The single-stage
criteria (:mod:`pullback_ext.prune.methods.single_stage`) and ASAP's single shot
(:mod:`pullback_ext.prune.methods.asap`) count the same way.
"""

from __future__ import annotations

from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods.base import Reduction
from pullback_ext.prune.tokens import split_budget


def stage_budgets(reduction: Reduction, num_patch: int, keep_one: bool = False) -> dict:
    """``{layer: tokens to remove}`` for a sequence with ``num_patch`` patch tokens (``keep_one``:
    one more token must stay, as ASAP's sink does)."""
    o = reduction.options
    budget = split_budget(num_patch, o.ratio, len(o.layers))
    room = (num_patch - 1 if o.mode == "merge" else num_patch) - int(keep_one)
    if sum(budget) > room:
        raise PullbackError(f"ratio {o.ratio} removes {sum(budget)} of {num_patch} patch tokens; at most {room} can go")
    return {layer: r for layer, r in zip(o.layers, budget) if r > 0}


def tokens_after_stages(reduction: Reduction, budgets: dict, num_patch: int) -> list:
    """Patch tokens each block processes when the stages remove ``budgets`` (``{layer: count}``)
    of ``num_patch``; with prune-mode LLF the last block runs on all of them again."""
    counts = [num_patch - sum(r for layer, r in budgets.items() if layer <= i) for i in range(reduction.backbone.depth)]
    if reduction.options.mode == "prune" and reduction.options.llf and budgets:
        counts[-1] = num_patch
    return counts
