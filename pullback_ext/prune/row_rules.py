"""The rules a token-reduction row is labelled by: which tokens it selects and how it averages.

Every comparison table of ``pullback evaluate`` (plain and ``--pareto``) names, for each row, the
method, its selection rule and its averaging rule, so that no row is known by a strategy name
alone: the originals by their authors' rules, our strategies by the rules their options resolve to.
"""

from __future__ import annotations

from pullback_ext.prune.reduction_options import Reduction
from pullback_ext.prune.strategies import NEEDS_SCORER

PRUNED = {"masked": "pruned, masked LLF", "full": "pruned, full LLF", False: "pruned, no LLF"}
ORIGINAL_RULES = {
    "tome": ("ToMe bipartite matching on head-mean keys, r per block (authors' rule)", "size-weighted, proportional attention"),
    "evit": ("top CLS attention at three blocks (authors' rule)", "inattentive tokens fused into one, attention-weighted"),
    "pitome": ("PiToMe: the 2r highest-energy tokens matched bipartitely on head-mean keys, per block (authors' rule)",
               "size-weighted, proportional attention"),
    "expedite": ("Expedite: local soft k-means into a grid of clusters at one block (authors' rule)",
                 "cluster means; full-resolution tokens rebuilt from the k nearest clusters"),
    "asap": ("ASAP (reconstruction): tokens nearest the attention sink in diffusion distance", "pooled per ring ∝ T_is"),
}


def describe(reduction: Reduction) -> dict:
    """``{method, selection, averaging}`` of a resolved reduction: the rules its row is labelled by."""
    o = reduction.options
    if o.strategy in ORIGINAL_RULES:
        selection, averaging = ORIGINAL_RULES[o.strategy]
        if o.strategy == "asap" and o.mode == "prune":
            averaging = PRUNED[o.llf]
    else:
        scored = o.strategy in NEEDS_SCORER
        if o.mode == "prune":
            selection = "lowest importance" if scored else _score_rule(o.strategy)
            averaging = PRUNED[o.llf]
        else:
            selection = ("bound imp·drift" if o.selection == "bound" else "lowest importance") if scored else _score_rule(o.strategy)
            matching = "pullback (Eq. 19)" if o.matching == "pullback" else "cosine"
            averaging = f"{o.weights}-weighted into the {matching} nearest"
    stages = "" if len(o.layers) == 1 else f", {len(o.layers)} stages {list(o.layers)}"  # the originals keep one
    return {"method": o.strategy + stages, "selection": selection, "averaging": averaging}


def row_label(reduction: Reduction) -> str:
    d = describe(reduction)
    return f"{d['method']} · {d['selection']} · {d['averaging']}"


def _score_rule(strategy: str) -> str:
    return "random tokens" if strategy == "random" else f"lowest {strategy}"
