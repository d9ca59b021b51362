"""ToFu as the comparisons in the field run it (Kim et al., "Token Fusion: Bridging the Gap between
Token Pruning and Token Merging", WACV 2024). The authors released no code; this follows the
re-implementation in ``hchautran/PiToMe@550b5deed94aadfeac28bfbe381d87e672044a40`` (``algo/tofu/``,
cited below as ``merge.py``, ``patch/timm.py``, ``patch/deit.py``), the one the PiToMe paper's
comparisons ran; ``Westlake-AI/OpenToMe@4b791cbc`` (``opentome/timm/tofu.py``) has the same rule.

In every block of ``block_range`` (default: all blocks), between attention and MLP, ToMe's
bipartite matching (:mod:`.tome`: A and B alternate by position, prefix tokens in neither; the
cosine of the head-mean keys; the ``r`` A tokens most similar to their best B token are matched,
``merge.py:37-53``) decides which tokens go; what happens to a matched pair depends on the block
(``patch/deit.py:85``: ``'tofu' if i > num_layers//2 else 'prune'``):

1. blocks ``i < merge_from`` (default ``⌊L/2⌋ + 1``: blocks 0-6 of 12) **prune**: the matched A token
   is dropped and its destination is left unchanged (``merge()`` has no branch for ``'prune'``,
   ``merge.py:55-74``, so ``dst`` is returned as it was);
2. blocks ``i ≥ merge_from`` merge with **MLERP** (``merge.py:63-69``): a destination ``d`` with
   sources ``S(d)`` becomes ``mean(x_d, x_s for s in S(d)) · max(‖x_d‖, ‖x_s‖) / ‖x_d‖``, the mean
   unweighted (each token once, ``scatter_reduce(..., 'mean')``) and ``‖x_d‖`` the destination's
   norm *before* the merge (``dst_norm``, taken at ``merge.py:64``).

The tokens continue as ``[prefix, unmerged A (in order), B]`` (``merge.py:74``). No proportional
attention: the re-implementation passes a size to its attention (``patch/timm.py:39,89-90``) but
never tracks one (``patch/deit.py:17``), so ``prop_attn`` defaults to off here (``True`` adds
``log(size)`` as ToMe does, sizes adding up in both kinds of block). A pruned or merged token's
positions get its destination's features wherever full-length features are read
(:meth:`MergedTokens.full`), as the re-implementation's source tracking attributes them.

Where it and the paper differ: the paper's MLERP normalises the *average* (``x̄ / ‖x̄‖ · max ‖x_i‖``,
norm exactly the largest), the code divides by the destination's pre-merge norm (norm
``‖x̄‖ · max / ‖x_d‖``); the paper chooses pruning where the model is sensitive to interpolated
inputs, the code fixes the switch after block ``⌊L/2⌋`` (its MAE patch merges late with a plain
mean, ``patch/mae.py:121``); the code's budget is a keep ratio per block (``r = floor(T − T·ratio)``
with ``T`` the current tokens including CLS, ``merge.py:29-32``, ``--ratio 0.9125``,
``main_ic.py:108``), here ToMe's ``r`` as OpenToMe states it. The paper evaluates ToFu off the shelf
and fine-tuned; every row here is frozen. Where the code is silent: registers are prefix tokens;
ties keep the position order; a zero-norm destination takes the plain mean.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional

import torch

from pullback_ext import ops
from pullback_ext.errors import PullbackError
from pullback_ext.prune.matching import working_precision
from pullback_ext.prune.merged_tokens import MergedTokens
from pullback_ext.prune.methods.base import BackboneShape, Needs, Reduction
from pullback_ext.prune.methods.merging import (Matching, MergeStep, MergingMethod, ToMeOptions, apply_matching,
                                                places_after_merge)
from pullback_ext.prune.methods.tome import bipartite_matching


def default_merge_from(depth: int) -> int:
    """The first MLERP block of a ``depth``-block model: ``depth // 2 + 1`` (blocks ``i > depth // 2``
    merge, the code's rule).
    >>> default_merge_from(12), default_merge_from(5)
    (7, 3)
    """
    return depth // 2 + 1


def _kept(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``[B, K - R]``: the positions of ``x [B, K, D]`` that are not in ``src [B, R]``, in order."""
    b, k, _ = x.shape
    return places_after_merge(torch.arange(k, device=x.device).expand(b, k), src)


def _added_sizes(sizes: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``[B, K - R]``: every destination's size plus its sources' (``sizes [B, K]``)."""
    return ops.merge_tokens(torch.ones_like(sizes[..., None]), sizes, src, dst, check_values=False)[1]


def pruned(x: torch.Tensor, sizes: torch.Tensor, src: torch.Tensor, dst: torch.Tensor):
    """ToFu's early blocks: ``(x [B, K - R, D], sizes [B, K - R])`` from ``x [B, K, D]``, the ``src``
    tokens dropped, every destination unchanged (sizes still add up)."""
    return ops.gather_tokens(x, _kept(x, src), check_values=False), _added_sizes(sizes, src, dst)


def mlerp(x: torch.Tensor, sizes: torch.Tensor, src: torch.Tensor, dst: torch.Tensor):
    """ToFu's later blocks: ``(x [B, K - R, D], sizes [B, K - R])``, every destination ``d`` the
    unweighted mean of itself and its sources times ``max(‖x_d‖, ‖x_s‖) / ‖x_d‖`` (``‖x_d‖`` before
    the merge); the other tokens unchanged."""
    mean = ops.merge_tokens(x, torch.ones_like(sizes), src, dst, check_values=False)[0]
    norms = working_precision(x).norm(dim=-1)
    largest = norms.scatter_reduce(1, dst, torch.gather(norms, 1, src), reduce="amax", include_self=True)
    scale = torch.where(norms > 0, largest / norms.clamp_min(torch.finfo(norms.dtype).tiny), 1.0)
    scale = torch.gather(scale, 1, _kept(x, src)).to(x.dtype)
    return mean * scale[..., None], _added_sizes(sizes, src, dst)


@dataclass(frozen=True)
class ToFuOptions(ToMeOptions):
    """ToMe's ``r`` (required), ``schedule`` and ``block_range``, and ``merge_from``: the first block
    (0-based) whose matched tokens merge with MLERP; the blocks before it prune (None: ``L // 2 + 1``
    of the model's ``L`` blocks, the code's switch; 0: MLERP everywhere; ``L``: pruning everywhere)."""

    merge_from: Optional[int] = None

    def __post_init__(self):
        super().__post_init__()
        m = self.merge_from
        if m is not None and (not isinstance(m, numbers.Integral) or isinstance(m, bool) or m < 0):
            raise PullbackError(f"merge_from must be None or an int >= 0 (the first block that merges with MLERP; "
                                f"the blocks before it prune); got {m!r}")
        object.__setattr__(self, "merge_from", None if m is None else int(m))


class ToFu(MergingMethod):
    name, short, title = "tofu", "ToFu", "ToFu (r tokens per block: pruned early, MLERP-merged later)"
    options_type = ToFuOptions
    needs = Needs(split_blocks="ToFu reduces between attention and MLP")
    rules = ("ToFu: ToMe bipartite matching on head-mean keys, r per block, the matched token pruned in the early blocks "
             "and merged in the later ones (authors' rule as re-implemented; run frozen here, the paper also fine-tunes)",
             "MLERP: unweighted mean rescaled to the largest norm; no proportional attention")
    sweep = {"r": (1, 2, 4, 6, 8, 12, 16, 20, 24)}

    def resolve(self, options, backbone: BackboneShape) -> dict:
        m = default_merge_from(backbone.depth) if options.merge_from is None else options.merge_from
        if m > backbone.depth:
            raise PullbackError(f"merge_from must be at most {backbone.depth} (every block prunes) for this "
                                f"{backbone.depth}-block model; got {m}")
        prop_attn = options.prop_attn if isinstance(options.prop_attn, bool) else False
        return dict(super().resolve(options, backbone), merge_from=m, prop_attn=prop_attn)

    def describe(self, reduction: Reduction) -> dict:
        o = reduction.options
        averaging = "MLERP: unweighted mean rescaled to the largest norm" + (
            ", proportional attention" if o.prop_attn else "; no proportional attention")
        return {"method": self.name, "selection": f"{self.rules[0]}; pruned before block {o.merge_from}",
                "averaging": averaging}

    def rank(self, step: MergeStep) -> Optional[Matching]:
        return bipartite_matching(step.attended.k, step.state.num_prefix, step.r)

    def apply(self, step: MergeStep, matching: Matching) -> MergedTokens:
        average = pruned if step.block < step.reduction.options.merge_from else mlerp
        return apply_matching(step.state, matching, average)


ORDER = 9
METHODS = (ToFu(),)
