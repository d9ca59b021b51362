"""The single-stage criteria: at each block of ``layers`` a stage removes its share of ``ratio`` of
the patch tokens with the lowest keep scores of one scorer of :mod:`pullback_ext.prune.strategies`
(``importance``, ``oracle``, ``random``, ``tome_score``, …), by pruning or merging.

A stage at layer ``ℓ`` acts on the input of block ``ℓ`` (0-based), i.e. on the features after
``ℓ`` blocks. In ``prune`` mode with Last-Layer Fusion the pruned tokens are re-inserted before the
final block, which then runs on the full sequence (``masked``: the kept tokens do not attend to the
re-inserted ones, whose frozen features are stale for a backbone that never saw them there).
Outputs and intermediates are always full-length ``[B, N, D]`` (frozen or unmerged features at the
reduced positions), so decoders that read token grids work unchanged.
"""

from __future__ import annotations

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.grids import grid_shape
from pullback_ext.prune import strategies
from pullback_ext.prune.matching import merge_drift, nearest_destinations, patch_distances, select_with_partners
from pullback_ext.prune.methods.base import PRUNED, BackboneShape, BlockLoop, Method, Needs, Reduction
from pullback_ext.prune.option_checks import check_layer_range
from pullback_ext.prune.recovery import recover_pruned
from pullback_ext.prune.stages import stage_budgets, tokens_after_stages
from pullback_ext.prune.strategies import NEEDS_SCORER, StageContext, lowest
from pullback_ext.prune.token_maps import report
from pullback_ext.prune.tokens import TokenState


def attention_blocks(attention: str, budgets: dict) -> set:
    """Blocks whose attention a scorer reading ``attention`` (``none``, ``last``, ``all``) needs."""
    if attention == "last":
        return {layer - 1 for layer in budgets}
    if attention == "all":
        wanted, start = set(), 0
        for layer in sorted(budgets):
            wanted.update(range(start, layer))
            start = layer
        return wanted
    return set()


def apply_stage(reduction: Reduction, state: TokenState, count: int, attentions: list, stage: int = 0) -> TokenState:
    """Remove ``count`` patch tokens from ``state`` by pruning or merging (``stage``: index of the
    stage in the options' ``layers``)."""
    o, scorer = reduction.options, reduction.strategy
    ctx = StageContext(x=state.x, num_prefix=state.num_prefix, has_cls=reduction.backbone.has_cls, attentions=attentions,
                       seed=0 if o.seed is None else o.seed, stage=stage)
    keep = scorer.keep_scores(ctx)
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
    weights = scorer.merge_weights(ctx) if (o.weights == "importance" and state.owner is None) else None
    return state.merge(selected, dst, weights)


class SingleStage(Method):
    """One scorer of :data:`pullback_ext.prune.strategies.SCORERS` run through the staged pipeline."""

    takes = ("ratio", "layers", "head", "spn", "matching", "eps", "weights", "selection", "llf", "preset", "recovery",
             "mode", "prop_attn")
    single_stage = True
    folds_attention = True
    staged = True

    def __init__(self, name: str, scorer_class):
        self.name = self.short = name
        self.title = scorer_class.title
        self.scorer_class = scorer_class
        self.attention = scorer_class.attention
        self.kind = "ours" if name in NEEDS_SCORER else "criterion"
        self.head_from = name if name in NEEDS_SCORER else None
        self.needs = Needs(class_token=scorer_class.reads_cls)

    def sweep_grid(self, mode: str, ratios: tuple) -> dict:
        """The ratios; with a scorer both of our rules side by side (merge: the selections; prune: the fusions)."""
        if self.name not in NEEDS_SCORER:
            return {"ratio": ratios}
        return {"ratio": ratios} | ({"selection": ("bound", "lowest")} if mode == "merge" else {"llf": ("masked", "full")})

    def sweep_base(self, base: dict) -> dict:
        return dict(base)

    def checked_head(self, head, layers: tuple):
        strategies.check_scorer(self.name, head)
        if self.name in NEEDS_SCORER and isinstance(head, (list, tuple)) and len(head) not in (1, len(layers)):
            raise PullbackError(f"head: give one scorer or one per stage; got {len(head)} for {len(layers)} stages {layers}")
        return super().checked_head(head, layers)

    def check(self, fields: dict, changed: set) -> None:
        strategy, mode, selection = self.name, fields["mode"], fields["selection"]
        if self.attention != "none" and fields["layers"][0] == 0:
            raise PullbackError(f"strategy {strategy!r} reads attention of earlier blocks, so layers must start at 1 or later; got 0")
        if fields["matching"] == "pullback" and fields["spn"] is None:
            raise PullbackError("matching='pullback' needs spn= (an SPN returning U and lam)")
        if fields["weights"] == "importance" and strategy not in NEEDS_SCORER:
            raise PullbackError(f"weights='importance' needs strategy 'importance' or 'oracle'; got {strategy!r}")
        if selection == "bound" and (mode == "prune" or strategy not in NEEDS_SCORER):
            raise PullbackError(f"selection='bound' needs mode='merge' and strategy 'importance' or 'oracle'; got {mode!r}, {strategy!r}")

    def resolve(self, options, backbone: BackboneShape) -> dict:
        mode = options.mode if options.mode != "auto" else ("prune" if backbone.dense_neck else "merge")
        if options.recovery is not None and mode != "prune":
            raise PullbackError("recovery applies to mode='prune' (merged tokens are not re-inserted); this reduction merges")
        check_layer_range(options.layers, backbone.depth, mode == "prune" and bool(options.llf))
        choices = dict(mode=mode, **_auto_choices(options, mode, self.name in NEEDS_SCORER))
        llf = choices.get("llf", options.llf)
        if options.prop_attn == "folded" and mode == "prune" and llf != "masked":
            raise PullbackError(f"prop_attn='folded' in prune mode runs masked LLF as two maskless attention calls; "
                                f"it needs llf='masked', got llf={llf!r}")
        return choices

    def build(self, options):
        return strategies.make_strategy(self.name, options.head)

    def run(self, reduction: Reduction, x: torch.Tensor, loop: BlockLoop, take=()):
        o = reduction.options
        state = TokenState.start(x, reduction.backbone.num_prefix)
        budgets = stage_budgets(reduction, state.num_patch)
        need_attention = attention_blocks(self.attention, budgets)
        grid = grid_shape(state.num_patch) if o.recovery is not None else None
        attentions: list = []
        taken = {}
        for i, block in enumerate(loop.blocks):
            if i in budgets:
                state = apply_stage(reduction, state, budgets[i], attentions, o.layers.index(i))
                if grid is not None:
                    state = recover_pruned(state, grid, o.recovery, newest=budgets[i])
                attentions = []
            if o.mode == "prune" and o.llf and i == reduction.backbone.depth - 1 and state.reduced:
                state = state.restore(masked=o.llf == "masked")
            bias = state.attention_bias(proportional=o.prop_attn)
            if i in need_attention:
                attentions.append(loop.attention_probs(block, state.x, bias))
            state.x = loop.call_block(block, state, bias)
            report(i, state.holders)
            if i in take:
                taken[i] = state.full()
        return state.full(), taken

    def patch_tokens_per_block(self, reduction: Reduction, num_patch: int) -> list:
        """The tokens each block processes (with prune-mode LLF the last block runs on all of them again)."""
        return tokens_after_stages(reduction, stage_budgets(reduction, num_patch), num_patch)

    def eta(self, reduction: Reduction, num_patch: int) -> float:
        """The total the stages remove (Last-Layer Fusion's re-insertion does not undo it)."""
        return sum(stage_budgets(reduction, num_patch).values()) / num_patch

    def describe(self, reduction: Reduction) -> dict:
        o, scored = reduction.options, self.name in NEEDS_SCORER
        rule = "random tokens" if self.name == "random" else f"lowest {self.name}"
        if o.mode == "prune":
            selection = "lowest importance" if scored else rule
            averaging = PRUNED[o.llf] if o.recovery is None else f"{PRUNED[o.llf]}, recovered at α = {o.recovery:g}"
        else:
            selection = ("bound imp·drift" if o.selection == "bound" else "lowest importance") if scored else rule
            matching = "pullback (Eq. 19)" if o.matching == "pullback" else "cosine"
            averaging = f"{o.weights}-weighted into the {matching} nearest"
        stages = "" if len(o.layers) == 1 else f", {len(o.layers)} stages {list(o.layers)}"
        return {"method": self.name + stages, "selection": selection, "averaging": averaging}


def _auto_choices(o, mode: str, scored: bool) -> dict:
    """The value of every field left at ``auto`` (besides ``mode``), for the chosen ``mode``."""
    paper = o.preset == "paper"
    choices = {
        "matching": "pullback" if o.spn is not None else "cosine",
        "weights": "importance" if (scored and paper) else "size",
        "prop_attn": mode == "merge",
        "selection": "bound" if (mode == "merge" and scored and not paper) else "lowest",
        "llf": "full" if paper else "masked",
    }
    return {name: value for name, value in choices.items() if isinstance(getattr(o, name), str) and getattr(o, name) == "auto"}


ORDER = 0
METHODS = tuple(SingleStage(name, scorer_class) for name, scorer_class in strategies.SCORERS.items())
