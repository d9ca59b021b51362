"""The reduction pipeline shared by every patched backbone: run the blocks, reducing tokens at
the scheduled layers, restoring full-length features where they are read.

A stage at layer ``ℓ`` acts on the input of block ``ℓ`` (0-based), i.e. on the features after
``ℓ`` blocks. In ``prune`` mode with Last-Layer Fusion the pruned tokens are re-inserted before the
final block, which then runs on the full sequence (``masked``: the kept tokens do not attend to the
re-inserted ones, whose frozen features are stale for a backbone that never saw them there).
Outputs and intermediates are always full-length ``[B, N, D]`` (frozen or unmerged features at the
reduced positions), so decoders that read token grids work unchanged. What to reduce comes as a
:class:`~pullback_ext.prune.reduction_options.Reduction` (``ReductionOptions.resolve``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.grids import grid_shape
from pullback_ext.prune import asap, evit, expedite, pitome, tome
from pullback_ext.prune.matching import merge_drift, nearest_destinations, patch_distances, select_with_partners
from pullback_ext.prune.recovery import recover_pruned
from pullback_ext.prune.reduction_options import Reduction
from pullback_ext.prune.split_block import SplitBlock
from pullback_ext.prune.strategies import ORIGINALS, StageContext, lowest
from pullback_ext.prune.tokens import TokenState, split_budget
from pullback_ext.tap import run as tap_run


def stage_budgets(reduction: Reduction, num_patch: int) -> dict:
    """``{layer: tokens to remove}`` for a sequence with ``num_patch`` patch tokens."""
    o = reduction.options
    budget = split_budget(num_patch, o.ratio, len(o.layers))
    room = num_patch - 1 if o.mode == "merge" else num_patch
    if o.strategy == "asap":
        room -= 1  # the sink stays, and a merge pools into at least one ring token
    if sum(budget) > room:
        raise PullbackError(f"ratio {o.ratio} removes {sum(budget)} of {num_patch} patch tokens; at most {room} can go")
    return {layer: r for layer, r in zip(o.layers, budget) if r > 0}


def _attention_blocks(reduction: Reduction, budgets: dict) -> set:
    """Blocks whose attention the strategy needs."""
    if reduction.strategy.attention == "last":
        return {layer - 1 for layer in budgets}
    if reduction.strategy.attention == "all":
        wanted, start = set(), 0
        for layer in sorted(budgets):
            wanted.update(range(start, layer))
            start = layer
        return wanted
    return set()


def apply_stage(reduction: Reduction, state: TokenState, count: int, attentions: list, stage: int = 0) -> TokenState:
    """Remove ``count`` patch tokens from ``state`` by pruning or merging (``stage``: index of the
    stage in the options' ``layers``)."""
    o, strategy = reduction.options, reduction.strategy
    ctx = StageContext(x=state.x, num_prefix=state.num_prefix, has_cls=reduction.backbone.has_cls, attentions=attentions,
                       seed=0 if reduction.options.seed is None else reduction.options.seed, stage=stage)
    keep = strategy.keep_scores(ctx)
    patch_dist = None  # distances from every patch token, shared by selection and matching
    if o.selection == "bound":
        patch_dist = patch_distances(state.x, state.num_prefix, o.matching, o.spn, o.eps)
        drift, nearest = merge_drift(state.x, state.num_prefix, o.matching, patch_dist=patch_dist)
        cost = drift if o.matching == "pullback" else keep.to(drift.dtype) * drift
        selected = select_with_partners(cost, nearest, count, state.num_prefix)
    else:
        selected = lowest(keep, count, state.num_prefix)
    if o.mode == "prune":
        return state.prune(selected)
    dst = nearest_destinations(state.x, selected, state.num_prefix, o.matching, o.spn, o.eps, patch_dist=patch_dist)
    weights = strategy.merge_weights(ctx) if (o.weights == "importance" and state.owner is None) else None
    return state.merge(selected, dst, weights)


def run_blocks(
    reduction: Reduction,
    x: torch.Tensor,
    blocks: Sequence,
    call_block: Callable,
    attention_probs: Callable,
    take: Sequence[int] = (),
    split: Optional[SplitBlock] = None,
):
    """Run ``blocks`` on ``x [B, N, D]`` with the token reductions of ``reduction``.

    ``call_block(block, state, bias)`` runs one block on ``state.x`` and returns the new current
    tokens (``bias``: additive attention mask or None); ``attention_probs(block, x, bias)`` gives
    its head-averaged attention ``[B, K, K]``; ``split`` runs a block in two halves, which the
    originals ``tome``, ``evit`` and ``pitome`` need (they reduce between attention and MLP, in their own loop;
    ``expedite`` clusters between two blocks in its own loop and needs no ``split``; the original
    ``asap`` reduces once, at a block input, in its own loop too; ``tap`` runs :func:`pullback_ext.tap.run.run`).
    Returns ``(final [B, N, D], {i: features after block i [B, N, D] for i in take})``.
    """
    if reduction.strategy.name == "asap":
        budgets = stage_budgets(reduction, x.shape[1] - reduction.backbone.num_prefix)
        return asap.run(reduction, x, blocks, call_block, attention_probs, take, budgets.get(reduction.options.layers[0], 0))
    if reduction.strategy.name == "tap":
        return tap_run.run(reduction, x, blocks, call_block, take)
    if reduction.strategy.name in ORIGINALS:
        if split is None and reduction.strategy.name != "expedite":
            raise PullbackError(f"strategy {reduction.strategy.name!r} reduces between attention and MLP, and this "
                                f"backbone's adapter cannot split its blocks (timm ViTs can: pullback_ext.patch.timm)")
        method = {"tome": tome, "evit": evit, "pitome": pitome, "expedite": expedite}[reduction.strategy.name]
        return method.run(reduction, x, blocks, call_block, split, take)
    o = reduction.options
    state = TokenState.start(x, reduction.backbone.num_prefix)
    budgets = stage_budgets(reduction, state.num_patch)
    need_attention = _attention_blocks(reduction, budgets)
    grid = grid_shape(state.num_patch) if o.recovery is not None else None
    attentions: list = []
    taken = {}
    for i, block in enumerate(blocks):
        if i in budgets:
            state = apply_stage(reduction, state, budgets[i], attentions, o.layers.index(i))
            if grid is not None:
                state = recover_pruned(state, grid, o.recovery, newest=budgets[i])
            attentions = []
        if o.mode == "prune" and o.llf and i == reduction.backbone.depth - 1 and state.reduced:
            state = state.restore(masked=o.llf == "masked")
        bias = state.attention_bias(proportional=o.prop_attn)
        if i in need_attention:
            attentions.append(attention_probs(block, state.x, bias))
        state.x = call_block(block, state, bias)
        if i in take:
            taken[i] = state.full()
    return state.full(), taken
