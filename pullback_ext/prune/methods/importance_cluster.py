"""Importance-weighted agglomerative clustering (``importance_cluster``): ATC's schedule with
importance_tome's merge cost between clusters.

ATC (:mod:`.atc`) clusters the patch tokens bottom-up at three blocks, by the ``1 - cos`` of their
keys with average linkage. This method keeps ATC's schedule and counts, and replaces the
linkage by the first-order error that merging two clusters makes in what the decoder reads,
the bound importance_tome ranks its pairs by (:mod:`.importance_tome`):

1. the importance head, if given, scores the tokens once, on the output of block ``score_layer``
   (the layer it was trained on): each token's energy is ``e = size · imp²`` (its ``imp²`` shrunk
   ``shrink`` toward the image's mean as importance_tome's are,
   :func:`~.importance_tome.shrunk`), and merged energies add. Without a head ``e = size``;
2. in the blocks of ``cluster_layers`` (``atc``: ATC's 3, 6, 9 of 12, scaled to the model's depth;
   ``inner``: every block after the scored one, block 0 without a head, but the last, which
   reaches further),
   between attention and MLP, the ``s``-th of them keeps ``int(N0 · keep_rate^s)`` of the model's
   ``N0`` patch tokens (ATC's count, :func:`~.atc.cluster_count`), or ``int(N0 · keep_rate^(s^taper))``
   with ``taper`` below 1: each later block then removes a smaller share, so that at a given cost
   the last blocks do not collapse to a handful of tokens (at 2× on the demo's depth decoder,
   ``taper=0.7`` over the inner blocks lowers the held-out crops' mean by a sixth and their worst
   crop below ToMe's: docs/importance_tome_findings.md §9);
3. a cluster ``c`` of the current patch tokens has a size ``S`` and an energy ``E`` (the sums
   over its tokens) and a key centre ``k_c``, the size-weighted mean of its tokens' unit
   head-mean keys (where the size-weighted merge of its tokens would sit);
4. merging clusters ``a`` and ``b`` moves ``a`` by ``S_b / (S_a + S_b)`` and ``b`` by
   ``S_a / (S_a + S_b)`` of ``k_b - k_a``, each move weighted by its energy: the cost is
   ``(E_a S_b² + E_b S_a²) / (S_a + S_b)² · ‖k_a - k_b‖²``, the square of importance_tome's bound
   with ``guard = 1`` (for two tokens the same ranking). With ``E = S`` (no head) it is Ward's
   criterion, the increase of the size-weighted sum of squares of the keys;
5. every step merges the two clusters of the lowest cost (ties as ATC breaks them: the first in
   row-major order of the cost matrix, a cluster named by its smallest member) and recomputes
   the merged cluster's costs from its new centre (its squared distances to the others by
   Lance–Williams for centroids), size and energy, until the count remains, in one op
   (:func:`pullback_ext.ops.agglomerate`, ``linkage="bound"``); every
   cluster becomes one token, the size-weighted mean of its members (ATC's ``merge_wavg``), with
   proportional attention from the first merge on (``prop_attn``).

Prefix tokens (CLS, registers) are never clustered. Full-length features give every original
token the features of the token that holds it (merge-and-restore), which a dense decoder reads.
Chosen for dense decoders: on held-out photo crops of the demo's depth decoder Ward's criterion at
ATC's blocks is below ATC's average linkage at 1.25× and 1.5× (docs/importance_tome_findings.md §8).
Every shape follows from ``keep_rate`` and the blocks: without the compiled op the clustering is a
loop of a fixed number of steps, unrolled when compiled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from pullback_ext import ops
from pullback_ext.errors import PullbackError
from pullback_ext.prune.matching import working_precision
from pullback_ext.prune.merged_tokens import MergedTokens
from pullback_ext.prune.methods.atc import ATC, checked_keep_rate, resolved_layers
from pullback_ext.prune.methods.base import BackboneShape, BlockLoopMethod
from pullback_ext.prune.methods.importance_tome import (SHRINK, checked_shrink, checked_single_head, head_layer, shrunk,
                                                        token_energy)
from pullback_ext.prune.methods.merging import Matching, MergeStep, apply_matching, key_metric, merge_values
from pullback_ext.prune.option_checks import count, is_real, layer_list


def squared_key_distances(unit: torch.Tensor) -> torch.Tensor:
    """``‖u_a − u_b‖² = 2 − 2 cos`` ``[B, n, n]`` of unit keys ``[B, n, d]``, without a ``[B, n, n, d]``
    difference: the upper triangle mirrored (symmetric to the last bit), 0 on the diagonal."""
    upper = torch.triu((2.0 - 2.0 * unit @ unit.transpose(1, 2)).clamp_min(0.0), diagonal=1)
    return upper + upper.transpose(1, 2)


def agglomerate_bound(unit: torch.Tensor, sizes: torch.Tensor, energy: torch.Tensor, count: int) -> torch.Tensor:
    """The greedy agglomeration of ``n`` tokens with unit-length keys ``unit [B, n, d]``, sizes and energies
    ``[B, n]`` (``unit``'s dtype) into ``count`` clusters by the bound; ``[B, n]``: the smallest member of
    each token's cluster (:func:`pullback_ext.ops.agglomerate`, ``linkage="bound"``)."""
    return ops.agglomerate(squared_key_distances(unit), sizes, energy, count=count, linkage="bound", check_values=False)


LAYER_SETS = ("atc", "inner")  # the named values of cluster_layers (see ImportanceClusterOptions)


def checked_layers(value):
    if isinstance(value, str):
        if value not in LAYER_SETS:
            raise PullbackError(f"cluster_layers must be 'atc' (ATC's blocks 3, 6, 9 of 12, scaled), 'inner' (every block "
                                f"after the scored one but the last) or block indices; got {value!r}")
        return value
    return layer_list(value, "cluster_layers")


def blocks_of(value, depth: int, after: int = 0) -> tuple:
    """The blocks ``cluster_layers`` names in a ``depth``-block model, checked; ``inner``: every block
    after block ``after`` (the scored one; 0 without a head) but the last."""
    if value == "inner":
        if after + 1 > depth - 2:
            raise PullbackError(f"cluster_layers='inner' names every block after block {after} but the last, and this "
                                f"{depth}-block model has none")
        return tuple(range(after + 1, depth - 1))
    return resolved_layers(None if value == "atc" else value, depth, "cluster_layers")


@dataclass(frozen=True)
class ImportanceClusterOptions:
    """``keep_rate`` in (0, 1] (required): the ``s``-th clustering block keeps ``int(N0 · keep_rate^s)``
    clusters of the ``N0`` patch tokens; ``cluster_layers``: the blocks that cluster, 0-based indices,
    ``atc`` (default: ATC's 3, 6, 9 of 12, scaled) or ``inner`` (every block after the scored one,
    block 0 without a head, but the last: further reach, docs/importance_tome_findings.md §8);
    ``score_layer``: the block whose output the head scores (None: the layer it was trained on),
    before the first clustering block; ``shrink`` in [0, 1]: each token's ``imp²`` moved that far
    toward its image's mean before it becomes an energy (as importance_tome's); ``taper`` in (0, 1]:
    the ``s``-th clustering block keeps ``int(N0 · keep_rate^(s^taper))`` (1: ATC's count; below 1
    the later blocks remove smaller shares)."""

    keep_rate: Optional[float] = None
    cluster_layers: tuple[int, ...] | Literal["atc", "inner"] = "atc"
    score_layer: Optional[int] = None
    shrink: float = SHRINK
    taper: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "keep_rate", checked_keep_rate(self.keep_rate))
        object.__setattr__(self, "cluster_layers", checked_layers(self.cluster_layers))
        if self.score_layer is not None:
            object.__setattr__(self, "score_layer", count("score_layer", self.score_layer, 0))
        object.__setattr__(self, "shrink", checked_shrink(self.shrink))
        if not is_real(self.taper) or not 0.0 < float(self.taper) <= 1.0:
            raise PullbackError(f"taper must be a number in (0, 1] (the s-th clustering block keeps "
                                f"int(N0 · keep_rate^(s^taper)); 1: ATC's count); got {self.taper!r}")
        object.__setattr__(self, "taper", float(self.taper))


class ImportanceCluster(ATC):
    """ATC's clustering blocks and counts (:class:`~.atc.ATC`) with the merge cost of
    importance_tome's bound between clusters, the learned importance (optional) weighting it."""

    name, short = "importance_cluster", "importance-weighted clustering"
    title = "importance-weighted clustering (tokens clustered agglomeratively at a few blocks by their merge's first-order error)"
    kind, head_from, head_optional = "ours", "importance", True
    options_type = ImportanceClusterOptions
    takes = ("prop_attn", "head")
    layers_field = "cluster_layers"
    sweep = {"keep_rate": (0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25), "cluster_layers": LAYER_SETS}

    def checked_head(self, head, layers: tuple):
        return checked_single_head(self.name, head)

    def resolve(self, options, backbone: BackboneShape) -> dict:
        score = None if options.head is None else head_layer(options.head) if options.score_layer is None else options.score_layer
        layers = blocks_of(options.cluster_layers, backbone.depth, 0 if score is None else score)
        choices = dict(BlockLoopMethod.resolve(self, options, backbone), cluster_layers=layers)
        if score is None:
            return choices
        first = layers[0]
        if score >= first:
            given = "score_layer" if options.score_layer is not None else "the layer the head was trained on"
            raise PullbackError(f"score_layer: the head scores block {score} ({given}), which must come before the first "
                                f"clustering block {first}; give a later cluster_layers= or an earlier score_layer=")
        return dict(choices, score_layer=score)

    def describe(self, reduction) -> dict:
        o = reduction.options
        scored = (f"head on block {o.score_layer}'s output" + (f", imp² shrunk {o.shrink:g} toward the image's mean" if o.shrink else "")
                  if o.head is not None else "no head: Ward's size-weighted criterion")
        return {"method": self.name,
                "selection": f"agglomerative clustering of the head-mean keys at blocks {', '.join(map(str, o.cluster_layers))}, "
                             f"the pair of the lowest imp-weighted first-order merge error first ({scored})"
                             + (f", the s-th clustering block keeping int(N0 · keep_rate^(s^{o.taper:g}))" if o.taper != 1.0 else ""),
                "averaging": "cluster means, size-weighted" + (", proportional attention" if o.prop_attn else "")
                             + "; merged tokens restored to their sources"}

    def taper(self, options) -> float:
        return options.taper

    def begin(self, reduction, merges: list[int]) -> dict:
        return {"energy": None}

    def after_block(self, reduction, block: int, state: MergedTokens, carry: dict) -> None:
        o = reduction.options
        if o.head is not None and block == o.score_layer:
            carry["energy"] = shrunk(token_energy(o.head, state.x, state.sizes), state.sizes, state.num_prefix, o.shrink)

    def cluster(self, step: MergeStep, count: int) -> torch.Tensor:
        state, p = step.state, step.state.num_prefix
        unit = key_metric(step.attended.k[:, :, p:])
        sizes = (torch.ones_like(unit[..., 0]) if state.sizes is None else
                 working_precision(state.sizes[:, p:]).to(unit.dtype))
        energy = sizes if step.carry["energy"] is None else step.carry["energy"][:, p:].to(unit.dtype)
        return agglomerate_bound(unit, sizes, energy, count)

    def apply(self, step: MergeStep, matching: Matching) -> MergedTokens:
        if step.carry["energy"] is not None:
            step.carry["energy"] = merge_values(step.carry["energy"], matching)
        return apply_matching(step.state, matching)


ORDER = 8
METHODS = (ImportanceCluster(),)
