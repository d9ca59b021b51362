"""PiToMe as its authors define it (Tran et al., "Accelerating Transformers with Spectrum-Preserving
Token Merging", NeurIPS 2024): ToMe's bipartite soft matching restricted to the tokens an *energy
score* marks as redundant, so that isolated, informative tokens are protected from merging.

In every block of ``block_range`` (default: all blocks), between attention and MLP, ``k`` tokens
merge (``k``: ``r`` of the schedule, see :func:`~pullback_ext.prune.methods.tome.block_merges`, clipped to
half the current patch tokens):

1. the metric is ToMe's: the cosine of the keys the block's attention used (after any ``k_norm``),
   averaged over heads; prefix tokens (CLS, registers) take no part: never scored, never merged,
   never merged into;
2. the energy of patch token ``i`` over the ``n`` current patch tokens is
   ``E_i = (1/n) Σ_j f_m(cos(k_i, k_j))`` with ``f_m(x) = x`` for ``x ≥ m`` and
   ``α (exp(x − m) − 1)`` below the margin (an ELU-like soft floor), ``α = energy_alpha``
   (paper: 1); the margin falls with depth, ``m = margin · (1 − i/L)`` in block ``i`` (0-based) of
   the model's ``L`` blocks (paper: ``m = 0.9 − 0.9 · l/L``, so ``margin`` defaults to 0.9);
3. the ``2k`` tokens of highest energy (large clusters of similar tokens) are the merge candidates;
   the other ``n − 2k`` are protected. Ranked by energy, the candidates alternate between set A
   (ranks 0, 2, 4, ...) and set B (ranks 1, 3, 5, ...);
4. every A token merges into its most similar B token (``|A| = k``); merged features are
   size-weighted averages and sizes add up.

From the first merge on every block adds ``log(size)`` to its attention logits (proportional
attention, as ToMe; ``prop_attn``). Merged tokens are given back to every source position wherever
full-length features are read (:meth:`MergedTokens.full`).

Where the paper is silent: ``j`` runs over all current patch tokens including ``i`` itself (a
constant ``f(1) = 1`` for every token, which leaves the ranking unchanged), each counted once
whatever its size; the margin's ``i`` counts all the model's blocks, not only those of
``block_range``; energy ties keep the current order; the tokens continue as ``[prefix, protected
(by descending energy), B (by rank)]``; ``r`` states the budget per block as ToMe does (the
paper's Algorithm 1 takes the number of merges ``k``; its experiments give it as a fraction of the
tokens kept per layer). The authors' released code differs from the paper in two details this
module does not follow: it uses ``ELU(x − m)`` (``x − m`` above the margin) and the margin
``0.9 − 0.8 · l/L``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods.base import Needs
from pullback_ext.prune.methods.merging import (Matching, MergeStep, MergingMethod, ToMeOptions, best_match, key_metric,
                                                matching_from_scores)
from pullback_ext.prune.option_checks import is_real


def merge_count(r: int, num_patch: int) -> int:
    """Tokens one block merges: ``r`` clipped to half the ``num_patch`` current patch tokens (the
    ``2k`` candidates must be patch tokens)."""
    return min(r, num_patch // 2)


def block_margins(margin: float, depth: int) -> list[float]:
    """The energy margin of each block ``i = 0 .. depth-1``: ``margin · (1 − i/depth)``.
    >>> block_margins(0.9, 3)
    [0.9, 0.6, 0.3]
    """
    return [margin * (depth - i) / depth for i in range(depth)]


def energy(metric: torch.Tensor, margin: float, alpha: float) -> torch.Tensor:
    """Energy ``[B, n]`` of ``n`` tokens with unit vectors ``metric [B, n, hd]``: the mean over all
    ``n`` tokens of ``f_m(cos)``, ``f_m(x) = x`` for ``x ≥ margin``, else ``alpha (exp(x − margin) − 1)``."""
    cos = metric @ metric.transpose(1, 2)
    return torch.where(cos >= margin, cos, alpha * torch.expm1(cos - margin)).mean(dim=-1)


def energy_matching(keys: torch.Tensor, num_prefix: int, r: int, margin: float, alpha: float) -> Optional[Matching]:
    """PiToMe's matching of ``r`` merges (clipped, see :func:`merge_count`) among the tokens whose keys
    are ``keys [B, H, K, hd]``: the order ``[prefix, protected, A, B]``, every A token into its most
    similar B token. None when nothing merges."""
    p, k = num_prefix, keys.shape[2]
    count = merge_count(r, k - p)
    if count == 0:
        return None
    metric = key_metric(keys)
    ranked = torch.argsort(energy(metric[:, p:], margin, alpha), dim=1, descending=True, stable=True) + p
    order, a_start = merge_order(ranked, p, count), k - 2 * count
    best, match = best_match(metric, order, a_start, count)
    return matching_from_scores(order, a_start, count, best, match, count)


def merge_order(ranked: torch.Tensor, num_prefix: int, count: int) -> torch.Tensor:
    """``[B, K]`` current indices as ``[prefix, protected, A, B]``, from the patch tokens ``ranked
    [B, n]`` by descending energy: the ``2·count`` first alternate between A and B, the rest are
    protected."""
    prefix = torch.arange(num_prefix, device=ranked.device).expand(ranked.shape[0], num_prefix)
    candidates = ranked[:, :2 * count]
    return torch.cat([prefix, ranked[:, 2 * count:], candidates[:, 0::2], candidates[:, 1::2]], dim=1)


@dataclass(frozen=True)
class PiToMeOptions(ToMeOptions):
    """ToMe's ``r`` (required), ``schedule`` and ``block_range``, and ``margin``: the energy margin
    of the first block, in [0, 1] (block ``i`` of ``L`` uses ``margin · (1 − i/L)``);
    ``energy_alpha``: ``α >= 0`` of the energy below the margin."""

    margin: float = 0.9
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
    name, short, title = "pitome", "PiToMe", "PiToMe (r high-energy tokens merged in every block)"
    options_type = PiToMeOptions
    needs = Needs(split_blocks="PiToMe merges between attention and MLP")
    rules = ("PiToMe: the 2r highest-energy tokens matched bipartitely on head-mean keys, per block (authors' rule)",
             "size-weighted, proportional attention")
    sweep = {"r": (1, 2, 4, 6, 8, 12, 16, 20, 24)}

    def merge_count(self, reduction, r: int, num_prefix: int, num_patch: int) -> int:
        return merge_count(r, num_patch)

    def rank(self, step: MergeStep) -> Optional[Matching]:
        o = step.reduction.options
        margin = block_margins(o.margin, step.reduction.backbone.depth)[step.block]
        return energy_matching(step.attended.k, step.state.num_prefix, step.r, margin, o.energy_alpha)


ORDER = 4
METHODS = (PiToMe(),)
