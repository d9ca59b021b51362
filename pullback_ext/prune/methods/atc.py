"""ATC as its authors run it (Haurum et al., "Agglomerative Token Clustering", ECCV 2024; code
``JoakimHaurum/ATC@227c94b``, below ``atc.py`` = ``ATC_setup/models/atc.py``).

In the blocks of ``atc_layers`` (default: the 0-based blocks 3, 6, 9 of a 12-block ViT, README.md:27
and :32, ``benchmark_merging_method.py:16``; scaled to the model's depth as EViT's are), between
attention and MLP (``atc.py:88-102``):

1. the distance of two current patch tokens is ``1 - cos`` of their keys averaged over heads, the
   keys of that block's attention (``atc.py:49``, ``:261-262``, ``:269``);
2. the patch tokens are clustered bottom-up: every token starts as a cluster and the two closest
   clusters merge, step by step, until ``int(N0 · keep_rate^s)`` clusters remain at the ``s``-th
   reduction block (``s`` = 1, 2, 3; ``N0``: the model's patch tokens, not the current ones,
   ``atc.py:158-159``), clipped to the current count (``atc.py:258``);
3. the distance of two clusters is their ``linkage`` (``atc.py:270``): ``single`` (the least member
   distance), ``complete`` (the largest) or ``average`` (the mean over all member pairs, UPGMA),
   **default** ``average`` (``train_deit.py:216``, ``atc.py:72``);
4. every cluster becomes one token, the size-weighted mean of its members, sizes add up
   (``merge_wavg``, ``atc.py:296-310``).

The class token is left out of the clustering and stays first (``atc.py:264-266``, ``:279-282``);
here every prefix token (CLS, registers) is. Proportional attention (``log(size)`` on the logits
from the first merge on, ``atc.py:53-54``) is on by default (``prop_attn``), as in the authors'
DeiT command (README.md:32), benchmark (``benchmark_merging_method.py:18``) and off-the-shelf patch
(``SSLBackbone_setup/token_reduc/patch/timm.py:118``); without it the authors' model forgets the
sizes after every block (``atc.py:218-219``), so later clusters are *plain* means of their current
tokens: ``prop_attn=False`` does the same here (sizes are still added up for the readers).
The authors fine-tune all of DeiT-T/S/B with ATC in place (``train_deit.py:308-316``, no layer
frozen by default, ``:160``; 30 epochs in README.md:32), from the DeiT checkpoints; this runs it on
a frozen model (their off-the-shelf evaluation uses a per-block ``r`` variant instead, not this one).

How the clustering runs: the authors fit ``sklearn.cluster.AgglomerativeClustering(metric=
"precomputed")`` per image on the host (``atc.py:270-275``), which without connectivity is
``scipy.cluster.hierarchy.linkage`` cut at the cluster count — the partition after the first
``n - k`` greedy merges (the three linkages are reducible: merge heights never fall). Here the
greedy agglomeration runs batched on the device in one op, :func:`pullback_ext.ops.agglomerate`
(compiled kernels for float32/float64 on CPU and CUDA; elsewhere its reference, a loop of ``n - k``
steps of tensor ops, unrolled when compiled): each step the closest pair of active clusters and a
Lance–Williams update of the distances (``average`` keeps the sums of the member distances and
divides by ``|A||B|``), no value read on the host. Ties, which scipy leaves to its algorithm: the
closest pair ``(a, b)``, ``a < b``, first in lexicographic order, a cluster named by its smallest
member (the current position) — the first minimum of the symmetric distance matrix in row-major order.

Where the authors' code differs or is silent: a count that truncates to 0 skips the block there
(``atc.py:92``), one cluster remains here; the cluster order after a merge is sklearn's label
order there, here each cluster is represented by its smallest member (the :class:`Matching`'s
``dst``, the others its ``src``, ``order`` unchanged), so the tokens keep their order and a cluster
sits where its first member was (on a RoPE backbone it keeps that member's rotary position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from pullback_ext import ops
from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods.base import BackboneShape, BlockLoopMethod, Needs, Reduction
from pullback_ext.prune.methods.merging import (Matching, MergeStep, MergingMethod, apply_matching, key_metric,
                                                size_weighted)
from pullback_ext.prune.option_checks import check_layer_range, is_real, layer_list, one_of
from pullback_ext.prune.schedules import scale_layers

REFERENCE_LAYERS = (3, 6, 9)  # 0-based: the 4th, 7th and 10th blocks of a 12-block DeiT
LINKAGES = ("average", "single", "complete")


def cluster_count(keep_rate: float, num_patch: int, stage: int, current: int, taper: float = 1.0) -> int:
    """Clusters at the ``stage``-th (1-based) reduction block: ``int(num_patch · keep_rate^stage)``
    of the model's ``num_patch`` patch tokens, as ATC computes it, between 1 and the ``current`` ones;
    with ``taper`` below 1 the exponent is ``stage^taper`` (importance_cluster's ``taper``).
    >>> [cluster_count(0.9, 196, s, 196) for s in (1, 2, 3)]
    [176, 158, 142]
    """
    return max(1, min(current, int(num_patch * keep_rate ** (stage ** taper))))


def cosine_distances(keys: torch.Tensor) -> torch.Tensor:
    """``1 - cos`` ``[B, n, n]`` of the head-mean keys ``[B, H, n, hd]``, exactly symmetric (the
    upper triangle mirrored), ``inf`` on the diagonal."""
    unit = key_metric(keys)
    upper = torch.triu(1.0 - unit @ unit.transpose(1, 2), diagonal=1)
    eye = torch.eye(unit.shape[1], dtype=torch.bool, device=unit.device)
    return (upper + upper.transpose(1, 2)).masked_fill(eye, float("inf"))


def agglomerate(dist: torch.Tensor, count: int, linkage: str) -> torch.Tensor:
    """The greedy agglomeration of ``n`` points with distances ``dist [B, n, n]`` (symmetric,
    ``inf`` on the diagonal) into ``count`` clusters by ``linkage``; ``[B, n]``: the smallest member of
    each point's cluster (:func:`pullback_ext.ops.agglomerate`)."""
    return ops.agglomerate(dist, count=count, linkage=linkage, check_values=False)


def cluster_matching(owner: torch.Tensor, count: int, num_prefix: int) -> Matching:
    """The :class:`Matching` of ``count`` clusters of the ``n`` patch tokens after ``num_prefix``
    prefix tokens (``owner [B, n]``: each token's cluster, named by its smallest member): the order
    unchanged, every member but the smallest (the ``src``, in order) merges into the smallest (its ``dst``)."""
    b, n = owner.shape
    stays = owner == torch.arange(n, device=owner.device)
    src = torch.argsort(stays.to(torch.int8), dim=1, stable=True)[:, :n - count]  # the merged-away first
    order = torch.arange(num_prefix + n, device=owner.device).expand(b, num_prefix + n)
    return Matching(order, src + num_prefix, torch.gather(owner, 1, src) + num_prefix)


def plain_mean(x: torch.Tensor, sizes: torch.Tensor, src: torch.Tensor, dst: torch.Tensor):
    """``(x [B, K - R, D], sizes [B, K - R])``: each destination the plain mean of itself and its
    sources (ATC without proportional attention), sizes still added up."""
    merged = ops.merge_tokens(x, torch.ones_like(sizes), src, dst, check_values=False)[0]
    return merged, ops.merge_tokens(sizes[..., None], sizes, src, dst, check_values=False)[1]


def checked_keep_rate(value) -> Optional[float]:
    if value is None:
        return None
    if not is_real(value) or not 0.0 < float(value) <= 1.0:
        raise PullbackError(f"keep_rate must be None or a float in (0, 1] (the fraction of patch tokens ATC keeps "
                            f"per reduction block); got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ATCOptions:
    """``keep_rate``: ρ in (0, 1] (required); the ``s``-th reduction block keeps ``int(N0 · ρ^s)``
    clusters of the ``N0`` patch tokens; ``linkage``: ``average`` (default), ``single`` or
    ``complete``; ``atc_layers``: the blocks that cluster (0-based; None: 3, 6, 9 of 12, scaled)."""

    keep_rate: Optional[float] = None
    linkage: Literal["average", "single", "complete"] = "average"
    atc_layers: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        object.__setattr__(self, "keep_rate", checked_keep_rate(self.keep_rate))
        object.__setattr__(self, "linkage", one_of("linkage", self.linkage, LINKAGES, auto=False))
        layers = None if self.atc_layers is None else layer_list(self.atc_layers, "atc_layers")
        object.__setattr__(self, "atc_layers", layers)


def resolved_layers(layers: Optional[tuple], depth: int, name: str = "atc_layers") -> tuple:
    """The option ``name`` (``atc_layers``) for a ``depth``-block model (None: ATC's 3, 6, 9 of 12,
    scaled), checked."""
    try:
        chosen = scale_layers(REFERENCE_LAYERS, depth) if layers is None else layers
    except PullbackError as exc:
        raise PullbackError(f"{name}: ATC's blocks 3, 6, 9 of 12 do not scale to this {depth}-block model "
                            f"({exc}); give {name}=") from None
    check_layer_range(chosen, depth, False, name)
    return chosen


class ATC(MergingMethod):
    """ATC on ToMe's loop (:class:`MergingMethod`), which does what ATC does around its clustering:
    the split blocks, proportional attention from the first merge on, and :func:`apply_matching`
    (the cluster averages, sizes, restore maps and rotary positions). ATC brings its schedule (a
    stage number at each block of ``atc_layers``: :meth:`block_merges`), its count (from
    ``keep_rate`` and the model's patch tokens, which the loop's per-request ``merge_count`` does
    not see: :meth:`patch_tokens_per_block` counts directly) and its ranking, a clustering."""

    name, short, title = "atc", "ATC", "ATC (tokens clustered agglomeratively at 3 blocks)"
    options_type = ATCOptions
    needs = Needs(split_blocks="ATC clusters the tokens between attention and MLP")
    required = ("keep_rate", "fraction of patch tokens kept per reduction block")
    rules = ("ATC: agglomerative clustering of the head-mean keys (cosine distance, average linkage) at three blocks "
             "(authors' rule; run frozen here, its authors fine-tune all of DeiT with it)",
             "cluster means, size-weighted, proportional attention")
    sweep = {"keep_rate": (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25)}
    layers_field = "atc_layers"  # the option naming the blocks that cluster

    def resolve(self, options, backbone: BackboneShape) -> dict:
        layers = resolved_layers(getattr(options, self.layers_field), backbone.depth, self.layers_field)
        return dict(BlockLoopMethod.resolve(self, options, backbone), **{self.layers_field: layers})  # no block_range

    def block_merges(self, reduction: Reduction) -> list[int]:
        """The stage number ``s`` (1-based) at each block of ``atc_layers``, 0 elsewhere (everywhere
        with ``keep_rate`` 1, which keeps every token: the blocks then run whole, as unpatched)."""
        o = reduction.options
        layers = getattr(o, self.layers_field) if o.keep_rate < 1.0 else ()
        return [layers.index(i) + 1 if i in layers else 0 for i in range(reduction.backbone.depth)]

    def rank(self, step: MergeStep) -> Optional[Matching]:
        state, o = step.state, step.reduction.options
        p, n = state.num_prefix, state.num_patch
        # the first reduction block sees every patch token: ATC's N0
        count = self.clusters_at(o, step.carry.setdefault("num_patch", n), step.r, n)
        if count >= n:
            return None
        with torch.no_grad():
            owner = self.cluster(step, count)
        return cluster_matching(owner, count, p)

    def clusters_at(self, options, num_patch: int, stage: int, current: int) -> int:
        """The clusters the ``stage``-th (1-based) clustering block keeps of the ``current`` patch
        tokens, the model having ``num_patch`` (:func:`cluster_count`)."""
        return cluster_count(options.keep_rate, num_patch, stage, current, taper=self.taper(options))

    def taper(self, options) -> float:
        """The exponent of the stage in the count (ATC's: 1)."""
        return 1.0

    def cluster(self, step: MergeStep, count: int) -> torch.Tensor:
        """``[B, n]``: the cluster (its smallest member) of each of the ``n`` current patch tokens
        when they are clustered into ``count``."""
        return agglomerate(cosine_distances(step.attended.k[:, :, step.state.num_prefix:]), count, step.reduction.options.linkage)

    def apply(self, step: MergeStep, matching: Matching):
        average = size_weighted if step.reduction.options.prop_attn else plain_mean
        return apply_matching(step.state, matching, average)

    def patch_tokens_per_block(self, reduction: Reduction, num_patch: int) -> list:
        counts, current = [], num_patch
        for stage in self.block_merges(reduction):
            if stage:
                current = self.clusters_at(reduction.options, num_patch, stage, current)
            counts.append(current)
        return counts

    def describe(self, reduction: Reduction) -> dict:
        """The rules with the linkage in use, and plain means when ``prop_attn=False``."""
        o = reduction.options
        selection = self.rules[0].replace("average linkage", f"{o.linkage} linkage")
        averaging = self.rules[1] if o.prop_attn else "cluster means, unweighted (the authors' sizes reset), no proportional attention"
        return {"method": self.name, "selection": selection, "averaging": averaging}


ORDER = 8
METHODS = (ATC(),)
