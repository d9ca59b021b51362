"""What our token reduction adds to a forward: importance-head scoring, selection and gather, and
LLF re-insertion, each as a share of the unpruned forward, next to the ToMe score's cost. All
timed in one interleaved run (:func:`~pullback_ext.comparison.cost.interleaved_wall_clock`)."""

from __future__ import annotations

import torch

from pullback_ext import ops
from prune_bench.models import ModelCase, stage_layers
from pullback_ext.comparison.cost import interleaved_wall_clock
from pullback_ext.metric.head import ImportanceHead
from pullback_ext.prune.strategies import StageContext, lowest, make_strategy
from pullback_ext.prune.tokens import TokenState, split_budget


def measure_overhead(case: ModelCase, size: int, batch: int, ratio: float, repeats: int, device: torch.device) -> dict:
    """Seconds (medians) of each step at the first stage of ``case`` (a timm ViT) and their
    percentages of the unpruned forward at ``batch`` images of ``size`` px."""
    model = case.build(size).to(device)
    head = ImportanceHead(case.embed_dim).to(device).eval().requires_grad_(False)
    x = torch.rand(batch, 3, size, size, device=device)
    layer = stage_layers(case.depth, 1)[0]
    with torch.no_grad():
        feats = model.blocks[:layer](model.norm_pre(model._pos_embed(model.patch_embed(x))))
    p = model.num_prefix_tokens
    count = split_budget(feats.shape[1] - p, ratio, 1)[0]
    importance, tome = make_strategy("importance", head), make_strategy("tome_score")
    ctx = StageContext(x=feats, num_prefix=p, has_cls=True)
    scores = importance.keep_scores(ctx)
    pruned = TokenState.start(feats, p).prune(lowest(scores, count, p))
    steps = {
        "unpruned forward": lambda: model(x),
        "importance-head scoring": lambda: importance.keep_scores(ctx),
        "selection and gather": lambda: TokenState.start(feats, p).prune(lowest(scores, count, p)),
        "LLF re-insertion": lambda: ops.reinsert_tokens(pruned.x, pruned.positions, pruned.frozen, pruned.frozen_positions),
        "ToMe scoring (for comparison)": lambda: lowest(tome.keep_scores(ctx), count, p),
    }
    seconds = {k: v["median_s"] for k, v in interleaved_wall_clock(steps, repeats=repeats, device=device).items()}
    full = seconds["unpruned forward"]
    added = sum(seconds[k] for k in ("importance-head scoring", "selection and gather", "LLF re-insertion"))
    return {
        "model": case.title, "image_size": size, "batch": batch, "layer": layer, "tokens": int(feats.shape[1]), "removed": count,
        "seconds": seconds, "percent_of_forward": {k: 100.0 * s / full for k, s in seconds.items()},
        "scoring_plus_llf_pct_of_forward": 100.0 * added / full,
        "over_tome_scoring_pct_of_forward": 100.0 * (added - seconds["ToMe scoring (for comparison)"]) / full,
        "head_parameters": sum(q.numel() for q in head.parameters()),
    }
