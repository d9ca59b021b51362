"""The reduction pipeline shared by every patched backbone: run the blocks, reducing tokens at
the scheduled layers, restoring full-length features where they are read.

A stage at layer ``ℓ`` acts on the input of block ``ℓ`` (0-based), i.e. on the features after
``ℓ`` blocks. In ``prune`` mode with Last-Layer Fusion the pruned tokens are re-inserted before the
final block, which then runs on the full sequence (``masked``: the kept tokens do not attend to the
re-inserted ones, whose frozen features are stale for a backbone that never saw them there).
Outputs and intermediates are always full-length ``[B, N, D]`` (frozen or unmerged features at the
reduced positions), so decoders that read token grids work unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune.matching import MATCHINGS, merge_drift, nearest_destinations, patch_distances, select_with_partners
from pullback_ext.prune.strategies import STRATEGIES, StageContext, Strategy, lowest, make_strategy
from pullback_ext.prune.tokens import TokenState, split_budget

MODES = ("merge", "prune")
WEIGHTS = ("size", "importance")
SELECTIONS = ("lowest", "bound")


@dataclass
class ReductionConfig:
    """A validated reduction plan for one backbone (see :func:`make_config`)."""

    mode: str
    ratio: object
    layers: tuple
    strategy: Strategy
    llf: object  # "masked", "full" or False
    matching: str
    spn: Optional[Callable]
    eps: Optional[float]
    prop_attn: bool
    weights: str
    selection: str
    seed: Optional[int]
    depth: int
    num_prefix: int
    has_cls: bool


def _check_ratio(ratio, num_layers: int):
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, list, tuple)):
        raise PullbackError(f"ratio must be a float in [0, 1) or one float per layer; got {ratio!r}")
    values = [ratio] if isinstance(ratio, (int, float)) else list(ratio)
    if not isinstance(ratio, (int, float)) and len(values) != num_layers:
        raise PullbackError(f"ratio has {len(values)} entries but layers has {num_layers}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 <= float(v) < 1.0) or v != v:
            raise PullbackError(f"ratio must lie in [0, 1); got {v!r}")
    if not isinstance(ratio, (int, float)) and sum(float(v) for v in values) >= 1.0:
        raise PullbackError(f"per-layer ratios must add up to less than 1; got {values}")
    return float(ratio) if isinstance(ratio, (int, float)) else tuple(float(v) for v in values)


LLF_MODES = ("masked", "full")


def _check_llf(llf):
    """``True`` is the default ``masked`` fusion; returns ``masked``, ``full`` or False."""
    if llf is True:
        return "masked"
    if llf is False or llf in LLF_MODES:
        return llf
    raise PullbackError(f"llf must be True, False, 'masked' or 'full'; got {llf!r}")


def _check_layers(layers, depth: int, mode: str, llf: bool) -> tuple:
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = (layers,)
    try:
        values = [int(layer) for layer in layers]
        if any(isinstance(layer, bool) or int(layer) != layer for layer in layers):
            raise TypeError
    except (TypeError, ValueError):
        raise PullbackError(f"layers must be block indices (ints); got {layers!r}") from None
    if not values:
        raise PullbackError("layers must name at least one block index")
    if sorted(set(values)) != values:
        raise PullbackError(f"layers must be strictly increasing; got {values}")
    last = depth - 2 if (mode == "prune" and llf) else depth - 1
    for layer in values:
        if not 0 <= layer <= last:
            why = " (with LLF the last block always runs on the full sequence)" if last == depth - 2 else ""
            raise PullbackError(f"layers must lie in [0, {last}] for this {depth}-block model{why}; got {layer}")
    return tuple(values)


def make_config(
    *,
    depth: int,
    num_prefix: int,
    has_cls: bool,
    head=None,
    ratio=0.3,
    layers=(4,),
    mode: str = "merge",
    strategy: str = "importance",
    llf=True,
    spn=None,
    matching: str = "auto",
    eps: Optional[float] = None,
    prop_attn="auto",
    weights: str = "auto",
    selection: str = "auto",
    seed: Optional[int] = 0,
) -> ReductionConfig:
    """Validate the user's options against a backbone with ``depth`` blocks and return the plan.

    ``matching='auto'`` is ``pullback`` when an SPN is given, else ``cosine``; ``weights='auto'``
    averages merged tokens by importance for the ``importance``/``oracle`` strategies and by size
    for the training-free ones. ``prop_attn='auto'`` is on in merge mode (a merged token keeps the
    attention mass of every token it absorbed, as in ToMe). ``selection``: which tokens a scorer
    strategy merges away: ``lowest`` importance, or the lowest first-order error ``bound``
    ``imp(s) · ‖x_t − x_s‖`` with ``t`` the token it would merge into (the pullback distance when
    matching in the pullback metric); ``auto`` is ``bound`` for merges and ``lowest`` for pruning.
    """
    if mode not in MODES:
        raise PullbackError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise PullbackError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    llf = _check_llf(llf)
    layers = _check_layers(layers, depth, mode, bool(llf))
    ratio = _check_ratio(ratio, len(layers))
    built = make_strategy(strategy, head)
    if isinstance(head, (list, tuple)) and strategy in ("importance", "oracle") and len(head) not in (1, len(layers)):
        raise PullbackError(f"head: give one scorer or one per stage; got {len(head)} for {len(layers)} stages {layers}")
    if strategy in ("evit", "cls_sim") and not has_cls:
        raise PullbackError(f"strategy {strategy!r} needs a class token; this model has none")
    if built.attention != "none" and layers[0] == 0:
        raise PullbackError(f"strategy {strategy!r} reads attention of earlier blocks, so layers must start at 1 or later; got 0")
    if matching == "auto":
        matching = "pullback" if spn is not None else "cosine"
    if matching not in MATCHINGS:
        raise PullbackError(f"matching must be one of auto, {', '.join(MATCHINGS)}; got {matching!r}")
    if matching == "pullback" and spn is None:
        raise PullbackError("matching='pullback' needs spn= (an SPN returning U and lam)")
    if weights == "auto":
        weights = "importance" if strategy in ("importance", "oracle") else "size"
    if weights not in WEIGHTS:
        raise PullbackError(f"weights must be one of auto, {', '.join(WEIGHTS)}; got {weights!r}")
    if weights == "importance" and strategy not in ("importance", "oracle"):
        raise PullbackError(f"weights='importance' needs strategy 'importance' or 'oracle'; got {strategy!r}")
    if prop_attn == "auto":
        prop_attn = mode == "merge"
    if not isinstance(prop_attn, bool):
        raise PullbackError(f"prop_attn must be True, False or 'auto'; got {prop_attn!r}")
    if selection == "auto":
        selection = "bound" if (mode == "merge" and strategy in ("importance", "oracle")) else "lowest"
    if selection not in SELECTIONS:
        raise PullbackError(f"selection must be one of auto, {', '.join(SELECTIONS)}; got {selection!r}")
    if selection == "bound" and (mode != "merge" or strategy not in ("importance", "oracle")):
        raise PullbackError(f"selection='bound' needs mode='merge' and strategy 'importance' or 'oracle'; got {mode!r}, {strategy!r}")
    return ReductionConfig(
        mode=mode, ratio=ratio, layers=layers, strategy=built, llf=llf, matching=matching, spn=spn,
        eps=eps, prop_attn=prop_attn, weights=weights, selection=selection, seed=seed, depth=depth, num_prefix=num_prefix,
        has_cls=has_cls,
    )


def stage_budgets(cfg: ReductionConfig, num_patch: int) -> dict:
    """``{layer: tokens to remove}`` for a sequence with ``num_patch`` patch tokens."""
    budget = split_budget(num_patch, cfg.ratio, len(cfg.layers))
    room = num_patch - 1 if cfg.mode == "merge" else num_patch
    if sum(budget) > room:
        raise PullbackError(f"ratio {cfg.ratio} removes {sum(budget)} of {num_patch} patch tokens; at most {room} can go")
    return {layer: r for layer, r in zip(cfg.layers, budget) if r > 0}


def _attention_blocks(cfg: ReductionConfig, budgets: dict) -> set:
    """Blocks whose attention the strategy needs."""
    if cfg.strategy.attention == "last":
        return {layer - 1 for layer in budgets}
    if cfg.strategy.attention == "all":
        wanted, start = set(), 0
        for layer in sorted(budgets):
            wanted.update(range(start, layer))
            start = layer
        return wanted
    return set()


def _random_generator(cfg: ReductionConfig, device: torch.device) -> Optional[torch.Generator]:
    if cfg.strategy.name != "random":
        return None
    g = torch.Generator(device=device)
    g.manual_seed(0 if cfg.seed is None else int(cfg.seed))
    return g


def apply_stage(cfg: ReductionConfig, state: TokenState, count: int, attentions: list, generator, stage: int = 0) -> TokenState:
    """Remove ``count`` patch tokens from ``state`` by pruning or merging (``stage``: index of the
    stage in ``cfg.layers``)."""
    ctx = StageContext(x=state.x, num_prefix=state.num_prefix, has_cls=cfg.has_cls, attentions=attentions, generator=generator,
                       stage=stage)
    keep = cfg.strategy.keep_scores(ctx)
    patch_dist = None  # distances from every patch token, shared by selection and matching
    if cfg.selection == "bound":
        patch_dist = patch_distances(state.x, state.num_prefix, cfg.matching, cfg.spn, cfg.eps)
        drift, nearest = merge_drift(state.x, state.num_prefix, cfg.matching, patch_dist=patch_dist)
        cost = drift if cfg.matching == "pullback" else keep.to(drift.dtype) * drift
        selected = select_with_partners(cost, nearest, count, state.num_prefix)
    else:
        selected = lowest(keep, count, state.num_prefix)
    if cfg.mode == "prune":
        return state.prune(selected)
    dst = nearest_destinations(state.x, selected, state.num_prefix, cfg.matching, cfg.spn, cfg.eps, patch_dist=patch_dist)
    weights = cfg.strategy.merge_weights(ctx) if (cfg.weights == "importance" and state.owner is None) else None
    return state.merge(selected, dst, weights)


def run_blocks(
    cfg: ReductionConfig,
    x: torch.Tensor,
    blocks: Sequence,
    call_block: Callable,
    attention_probs: Callable,
    take: Sequence[int] = (),
):
    """Run ``blocks`` on ``x [B, N, D]`` with the reductions of ``cfg``.

    ``call_block(block, state, bias)`` runs one block on ``state.x`` and returns the new current
    tokens (``bias``: additive attention mask or None); ``attention_probs(block, x, bias)`` gives
    its head-averaged attention ``[B, K, K]``.
    Returns ``(final [B, N, D], {i: features after block i [B, N, D] for i in take})``.
    """
    state = TokenState.start(x, cfg.num_prefix)
    budgets = stage_budgets(cfg, state.num_patch)
    need_attention = _attention_blocks(cfg, budgets)
    generator = _random_generator(cfg, x.device)
    attentions: list = []
    taken = {}
    for i, block in enumerate(blocks):
        if i in budgets:
            state = apply_stage(cfg, state, budgets[i], attentions, generator, cfg.layers.index(i))
            attentions = []
        if cfg.mode == "prune" and cfg.llf and i == cfg.depth - 1 and state.reduced:
            state = state.restore(masked=cfg.llf == "masked")
        bias = state.attention_bias(proportional=cfg.prop_attn)
        if i in need_attention:
            attentions.append(attention_probs(block, state.x, bias))
        state.x = call_block(block, state, bias)
        if i in take:
            taken[i] = state.full()
    return state.full(), taken
