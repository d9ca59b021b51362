"""PiToMe as its authors run it (Tran et al., "Accelerating Transformers with Spectrum-Preserving
Token Merging", NeurIPS 2024; the rule of their code, hchautran/PiToMe @ 550b5de, its timm / DeiT
patch ``algo/pitome/patch/deit.py``, ``patch/timm.py`` and ``algo/pitome/merge.py``, which gave
their published ImageNet numbers; run frozen here, as they also evaluate it off the shelf).

In every block of ``block_range`` (default: all blocks), between attention and MLP, ``k`` tokens
merge (``k``: ``r`` of the schedule, see :func:`~pullback_ext.prune.methods.merging.block_merges`,
clipped to half the current patch tokens):

1. the metric is ToMe's: the cosine of the keys the block's attention used (after any ``k_norm``),
   averaged over heads (``patch/timm.py:100``); prefix tokens (CLS, registers) take no part: never
   scored, never merged, never merged into (``merge.py:159-160, 131-133``);
2. the energy of patch token ``i`` over the ``n`` current patch tokens is
   ``E_i = (1/n) Σ_j ELU(cos(k_i, k_j) − m, α)``, ``j`` over all of them, ``i`` included
   (``merge.py:167-171``; ``α = energy_alpha``, 1 in their code, ``merge.py:152``); the margin
   falls with depth, ``m = margin · (1 − i/L)`` in block ``i`` (0-based) of the model's ``L``
   blocks, ``margin = 0.75`` (``deit.py:98``);
3. in the first ``⌈L/2⌉`` blocks of the model (``deit.py:33-34``, ``merge.py:172-173``) the tokens
   are matched as ToMe matches them, with the energy ordering the split only: ranked by energy, the
   patch tokens alternate between set A (ranks 0, 2, 4, ...) and set B (ranks 1, 3, ...), each A
   token finds its most similar B token and the ``k`` A tokens of the highest similarity merge
   (``merge.py:110-145``); nothing is protected;
4. in the later blocks the ``2k`` tokens of highest energy are the merge candidates and the other
   ``n − 2k`` are protected; the candidates alternate between A and B by energy rank and every A
   token merges into its most similar B token (``merge.py:73-107``);
5. merged features are size-weighted averages and sizes add up (``merge.py:249-263``). The
   attention runs unchanged: their block calls it without the sizes (``patch/timm.py:38``), so no
   proportional attention (``prop_attn=False`` by default here; ``prop_attn=True`` adds ToMe's).

Merged tokens are given back to every source position wherever full-length features are read
(:meth:`MergedTokens.full`).

Where this differs from their code, and why: the budget is ToMe's ``r`` per block (their patch
takes a keep ratio, ``k = floor(n · (1 − ratio))`` of the current patch tokens, ``merge.py:161-163``),
so that rows at matched cost compare equal token counts; ``k`` is clipped to ``⌊n/2⌋`` in both
halves (their first half could take ``⌈n/2⌉``; no ratio they run reaches it); registers are kept
like the class token (their code knows only a class token); energy ties keep the current order
(their ``argsort`` is not stable). The order of the tokens after a merge, which differs from
theirs, does not change the result: the next block ranks them by energy again.

Where the paper differs from the code: it protects the low-energy tokens in every block
(Algorithm 1), writes the energy with ``x`` rather than ``x − m`` above the margin, and states the
margin ``0.9 − 0.9 · l/L``; its released code is what gave its numbers, and is followed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods.base import Needs
from pullback_ext.prune.methods.merging import (Matching, MergeStep, MergingMethod, ToMeOptions, best_match, fused_merge,
                                                key_metric, matching_from_scores)
from pullback_ext.prune.option_checks import is_real
# PiToMe's pieces, shared with the reference of the fused merge step (ops.merge_step)
from pullback_ext.reference import energy_order as merge_order  # noqa: F401
from pullback_ext.reference import pitome_count as merge_count  # noqa: F401
from pullback_ext.reference import pitome_energy as energy  # noqa: F401


def block_margins(margin: float, depth: int) -> list[float]:
    """The energy margin of each block ``i = 0 .. depth-1``: ``margin · (1 − i/depth)``.
    >>> block_margins(0.75, 3)
    [0.75, 0.5, 0.25]
    """
    return [margin * (depth - i) / depth for i in range(depth)]


def bipartite_blocks(depth: int) -> int:
    """How many of a ``depth``-block model's first blocks match all tokens, unprotected: ``⌈depth/2⌉``."""
    return math.ceil(depth / 2)


def energy_matching(keys: torch.Tensor, num_prefix: int, r: int, margin: float, alpha: float,
                    protect: bool) -> Optional[Matching]:
    """PiToMe's matching of ``r`` merges (clipped, see :func:`merge_count`) among the tokens whose keys
    are ``keys [B, H, K, hd]``: with ``protect``, the order ``[prefix, protected, A, B]`` and every
    A token into its most similar B token; without, ``[prefix, A, B]`` over all patch tokens and
    ToMe's ``r`` most similar pairs. None when nothing merges."""
    p, k = num_prefix, keys.shape[2]
    count = merge_count(r, k - p)
    if count == 0:
        return None
    metric = key_metric(keys)
    ranked = torch.argsort(energy(metric[:, p:], margin, alpha), dim=1, descending=True, stable=True) + p
    order, a_start, size_a = merge_order(ranked, p, 2 * count if protect else k - p)
    best, match = best_match(metric, order, a_start, size_a)
    return matching_from_scores(order, a_start, size_a, best, match, count)


@dataclass(frozen=True)
class PiToMeOptions(ToMeOptions):
    """ToMe's ``r`` (required), ``schedule`` and ``block_range``, and ``margin``: the energy margin
    of the first block, in [0, 1] (block ``i`` of ``L`` uses ``margin · (1 − i/L)``; the authors'
    0.75); ``energy_alpha``: ``α >= 0`` of the ELU below the margin (the authors' 1)."""

    margin: float = 0.75
    energy_alpha: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not is_real(self.margin) or not 0.0 <= float(self.margin) <= 1.0:
            raise PullbackError(f"margin must be a float in [0, 1] (PiToMe's energy margin of the first block); got {self.margin!r}")
        if not is_real(self.energy_alpha) or not 0.0 <= float(self.energy_alpha) < float("inf"):
            raise PullbackError(f"energy_alpha must be a finite float >= 0 (PiToMe's α below the margin); got {self.energy_alpha!r}")
        object.__setattr__(self, "margin", float(self.margin))
        object.__setattr__(self, "energy_alpha", float(self.energy_alpha))


class PiToMe(MergingMethod):
    name, short, title = "pitome", "PiToMe", "PiToMe (r tokens merged in every block, high-energy ones in the later half)"
    options_type = PiToMeOptions
    needs = Needs(split_blocks="PiToMe merges between attention and MLP")
    rules = ("PiToMe: bipartite matching ordered by energy, the 2r highest-energy tokens only in the later half of the "
             "blocks, on head-mean keys (authors' code)", "size-weighted, no proportional attention (authors' code)")
    sweep = {"r": (1, 2, 4, 6, 8, 12, 16, 20, 24)}
    prop_attn_default = False

    def merge_count(self, reduction, r: int, num_prefix: int, num_patch: int) -> int:
        return merge_count(r, num_patch)

    def rank(self, step: MergeStep) -> Optional[Matching]:
        o, depth = step.reduction.options, step.reduction.backbone.depth
        margin = block_margins(o.margin, depth)[step.block]
        protect = step.block >= bipartite_blocks(depth)
        return energy_matching(step.attended.k, step.state.num_prefix, step.r, margin, o.energy_alpha, protect)

    def merge(self, step: MergeStep):
        o, depth = step.reduction.options, step.reduction.backbone.depth
        rule = "pitome_protected" if step.block >= bipartite_blocks(depth) else "pitome"
        fused = fused_merge(step, rule, margin=block_margins(o.margin, depth)[step.block], alpha=o.energy_alpha)
        return super().merge(step) if fused is None else fused[0]


ORDER = 4
METHODS = (PiToMe(),)
