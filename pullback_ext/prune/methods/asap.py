"""ASAP (Lee, Kim, Kim, Lee, "ASAP: Attention Sink Anchored Pruning", arXiv 2605.22372, 2026),
reconstructed from its abstract: the paper has no public code, and this module is the
project's reading of it, not the authors' implementation.

What the abstract fixes: ViT information flow is a *lazy random walk* over the attention; the
*sink* is the dominant accumulator of probability mass in the cumulative transition matrix and is
the anchor of the method; the *diffusion distance to the sink* partitions the tokens by *radial
diffusion clustering*; background redundancy is compressed by *transition weight pooling*; the
whole reduction happens *in a single shot*, without training.

The reduction, at the input of block ``ℓ = layers[0]`` (a single stage, like the project's
stages), on the ``K`` tokens there (prefix first, then ``n`` patch tokens), removing ``R`` of them:

1. ``A_l [K, K]``: the attention probabilities of block ``l < ℓ``, averaged over heads; the lazy
   walk ``P_l = α I + (1 − α) A_l`` with ``α = ½`` (:data:`~pullback_ext.prune.attention_sink.ALPHA`);
   ``T = P_{ℓ−1} ⋯ P_0``;
2. the sink ``s = argmax_j Σ_i T_ij`` (over every token, prefix included: a CLS or register sink
   is kept anyway), ``π = Σ_i T_i· / K`` and ``d_i = ‖(T_i· − T_s·) / sqrt(π)‖`` (``π`` floored at
   1e-12);
3. the background: the patch tokens nearest the sink in ``d`` (ties by position). The sink, CLS
   and registers are never background;
4. ``mode="prune"`` (dense decoders): the ``R`` background tokens are pruned through the project's
   prune mode (:meth:`TokenState.prune <pullback_ext.prune.tokens.TokenState.prune>`): their
   features at the stage are frozen and given back at their positions wherever full-length
   features are read, and with ``llf`` before the last block (Last-Layer Fusion, the project's
   addition; ``llf=False`` is the bare method);
5. ``mode="merge"`` (CLS decoders): the ``R + m`` background tokens, ``m = min(rings, n − 1 − R)``,
   in order of ``d``, form ``m`` rings of equal count (sizes differ by at most one, the inner
   rings take the remainder, as ``numpy.array_split``); each ring becomes one token
   ``Σ_i T_is x_i / Σ_i T_is`` (the weights are the walk's probability of reaching the sink),
   at the place of its first member in the sequence, of size ``|ring|``. Sizes feed proportional
   attention (``prop_attn``, on by default in merge mode) and the merge map gives every pooled
   token's features back to all its members in full-length features.

Choices where the abstract is silent: the stage at a block *input* with the walk over the blocks
before it (``layers`` must be ≥ 1); ``ratio`` is the *net* fraction of patch tokens removed, as
in every merge of the project, so η = ``ratio`` whatever ``rings`` (a pooled token counts as
kept, so a merge removes at most ``n − 2`` patch tokens: the sink and one ring token stay; a
prune at most ``n − 1``); rings by equal count over the background (not equal width in ``d``,
which leaves rings empty and token counts image-dependent), ``rings = 4`` by default; only the
background is cut into rings, the foreground tokens stay as they are; a pooled token sits at its
ring's first member (only the sequence order depends on it); the sink is found once, on the full
sequence; ``T`` in float64; pooling weights floored at the smallest normal number of the feature
dtype; proportional attention and Last-Layer Fusion are the project's. timm ``VisionTransformer``,
the Hugging Face families (:mod:`pullback_ext.prune.hf_split`) and timm Eva (each token at its own
rotary position, a pooled token at its ring's first member's).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune.attention_sink import ALPHA, lazy_walk, sink_distances
from pullback_ext.prune.merged_tokens import run_tracked
from pullback_ext.prune.methods.base import PRUNED, BackboneShape, BlockLoop, Method
from pullback_ext.prune.option_checks import check_layer_range
from pullback_ext.prune.stages import stage_budgets, tokens_after_stages
from pullback_ext.prune.tokens import TokenState


def pooling_weights(t: torch.Tensor, sink: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Transition weights ``T_is`` ``[B, K]`` of every token to the sink, in ``dtype``, floored so
    that every ring has a positive total."""
    w = torch.gather(t, 2, sink[:, None, None].expand(-1, t.shape[1], 1))[..., 0].to(dtype)
    return w.clamp_min(torch.finfo(dtype).tiny)


def background(d: torch.Tensor, sink: torch.Tensor, num_prefix: int, count: int) -> torch.Tensor:
    """Positions ``[B, count]`` of the ``count`` patch tokens nearest the sink in ``d [B, K]``
    (the sink and the prefix excluded), nearest first, ties by position."""
    far = d.clone()
    far[:, :num_prefix] = float("inf")
    far.scatter_(1, sink[:, None], float("inf"))
    return torch.argsort(far, dim=1, stable=True)[:, :count]


def ring_sizes(count: int, rings: int) -> list[int]:
    """Members of each of ``rings`` equal-count rings of ``count`` tokens, innermost first.
    >>> ring_sizes(10, 4)
    [3, 3, 2, 2]
    """
    base, extra = divmod(count, rings)
    return [base + (1 if r < extra else 0) for r in range(rings)]


def ring_merges(members: torch.Tensor, rings: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst)`` ``[B, count − rings]``: the background ``members [B, count]`` (nearest the
    sink first) cut into rings (:func:`ring_sizes`); every member but the first in sequence order
    of its ring goes into that first one."""
    src, dst = [], []
    for ring in members.split(ring_sizes(members.shape[1], rings), dim=1):
        ordered = ring.sort(dim=1).values
        src.append(ordered[:, 1:])
        dst.append(ordered[:, :1].expand(-1, ordered.shape[1] - 1))
    return torch.cat(src, dim=1), torch.cat(dst, dim=1)


def reduce(state: TokenState, attentions: list, count: int, options) -> TokenState:
    """The single-shot reduction of ``count`` patch tokens of ``state`` (``attentions``: the
    head-averaged attention ``[B, K, K]`` of every block before the stage; ``options``: resolved,
    for ``mode`` and ``rings``)."""
    t = lazy_walk(attentions, ALPHA)
    sink, d = sink_distances(t)
    if options.mode == "prune":
        return state.prune(background(d, sink, state.num_prefix, count))
    rings = min(options.rings, state.num_patch - 1 - count)
    src, dst = ring_merges(background(d, sink, state.num_prefix, count + rings), rings)
    return state.merge(src, dst, pooling_weights(t, sink, state.x.dtype))


def run(reduction, x: torch.Tensor, blocks, call_block, attention_probs, take, count: int):
    """Run ``blocks`` on ``x [B, N, D]`` with ASAP removing ``count`` patch tokens at the input of
    block ``layers[0]`` (``reduction``: resolved options with ``strategy="asap"``; ``call_block``,
    ``attention_probs``: see :func:`~pullback_ext.prune.pipeline.run_blocks`). Returns ``(final
    [B, N, D], {i: features after block i [B, N, D] for i in take})``, full-length."""
    o = reduction.options
    layer, last = o.layers[0], reduction.backbone.depth - 1
    attentions: list = []

    def step(i: int, block, state: TokenState) -> TokenState:
        if i == layer and count:
            state = reduce(state, attentions, count, o)
        if o.mode == "prune" and o.llf and i == last and state.reduced:
            state = state.restore(masked=o.llf == "masked")
        bias = state.attention_bias(proportional=o.prop_attn)
        if i < layer and count:
            attentions.append(attention_probs(block, state.x, bias))
        return replace(state, x=call_block(block, state, bias))

    return run_tracked(TokenState.start(x, reduction.backbone.num_prefix), blocks, step, take)


@dataclass(frozen=True)
class ASAPOptions:
    """``rings``: how many rings of background tokens merge mode pools into one token each (an
    int >= 1; no effect in prune mode)."""

    rings: int = 4

    def __post_init__(self):
        if not isinstance(self.rings, numbers.Integral) or isinstance(self.rings, bool) or self.rings < 1:
            raise PullbackError(f"rings must be an int >= 1 (rings of background tokens ASAP pools); got {self.rings!r}")
        object.__setattr__(self, "rings", int(self.rings))


class ASAP(Method):
    """ASAP reconstructed: one stage at ``layers`` (one block, 1 or later) of ``ratio``."""

    name, short = "asap", "ASAP"
    title = "ASAP (the sink-anchored method of its abstract, reconstructed: background pooled per ring or pruned in one shot)"
    options_type = ASAPOptions
    takes = ("ratio", "layers", "mode", "llf", "prop_attn")
    attention = "all"
    staged = True
    own_loop = True
    sweep = {}

    def sweep_base(self, base: dict) -> dict:
        return {"layers": base["layers"][:1], "mode": base["mode"]}

    def check(self, fields: dict, changed: set) -> None:
        super().check(fields, changed)
        layers = fields["layers"]
        if len(layers) != 1:
            raise PullbackError(f"strategy 'asap' reduces in a single shot: layers must name one block; got {layers}")
        if layers[0] == 0:
            raise PullbackError("strategy 'asap' walks the attention of the blocks before its stage, so layers must be 1 or later; got 0")

    def resolve(self, options, backbone: BackboneShape) -> dict:
        """``mode`` (``auto``: prune for a dense neck) and ``prop_attn`` (``auto``: in merge mode)."""
        mode = options.mode if options.mode != "auto" else ("prune" if backbone.dense_neck else "merge")
        check_layer_range(options.layers, backbone.depth, mode == "prune" and bool(options.llf))
        return {"mode": mode, "prop_attn": options.prop_attn if isinstance(options.prop_attn, bool) else mode == "merge",
                "llf": "masked" if options.llf == "auto" else options.llf}

    def run(self, reduction, x: torch.Tensor, loop: BlockLoop, take=()):
        budgets = stage_budgets(reduction, x.shape[1] - reduction.backbone.num_prefix, keep_one=True)
        return run(reduction, x, loop.blocks, loop.call_block, loop.attention_probs, take,
                   budgets.get(reduction.options.layers[0], 0))

    def patch_tokens_per_block(self, reduction, num_patch: int) -> list:
        """The single-stage count (pooled ring tokens count as kept)."""
        return tokens_after_stages(reduction, stage_budgets(reduction, num_patch, keep_one=True), num_patch)

    def eta(self, reduction, num_patch: int) -> float:
        return sum(stage_budgets(reduction, num_patch, keep_one=True).values()) / num_patch

    def describe(self, reduction) -> dict:
        o = reduction.options
        averaging = PRUNED[o.llf] if o.mode == "prune" else "pooled per ring ∝ T_is"
        return {"method": "asap", "selection": "ASAP (reconstruction): tokens nearest the attention sink in diffusion distance",
                "averaging": averaging}


ORDER = 3
METHODS = (ASAP(),)
