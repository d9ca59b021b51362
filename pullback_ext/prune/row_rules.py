"""The rules a token-reduction row is labelled by: which tokens it selects and how it averages.

Every comparison table of ``pullback evaluate`` (plain and ``--pareto``) names, for each row, the
method, its selection rule and its averaging rule, so that no row is known by a strategy name
alone: the originals by their authors' rules, our strategies by the rules their options resolve to,
TAP by its variant (TAP-F, TAP-J) and its register's layers and task.
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


def tap_rules(register) -> tuple[str, str, str]:
    """``(method, selection, averaging)`` of TAP with the trained ``register``
    (:class:`~pullback_ext.tap.register.TaskRegister`): TAP-F, or TAP-J with its LoRA rank."""
    start, stop = register.layers
    method = f"TAP-J (LoRA rank {register.lora_rank})" if register.adapted else "TAP-F"
    selection = (f"lowest task-register score; exact budget, split over block inputs {start}–{stop - 1} "
                 "by the register's read-out (per batch)")
    averaging = "pruned, re-inserted as α·frozen + (1 − α)·kept-neighbour mean, masked LLF" if register.task == "depth" \
        else "pruned, removed tokens dropped"
    return method, selection, averaging


def tap_row(register, name: str, unpruned: bool = False) -> str:
    """The row label of the TAP checkpoint ``name``; ``unpruned``: its one-point row at ρ = 1, whose
    error is the register's (and TAP-J's adapted backbone's) alone."""
    method, selection, averaging = tap_rules(register)
    if unpruned:
        alone = "the adapted backbone and the register" if register.adapted else "the register token"
        return f"{method} [{name}] · nothing removed (ρ = 1) · {alone} against the frozen unpruned model"
    return f"{method} [{name}] · {selection} · {averaging}"


def describe(reduction: Reduction) -> dict:
    """``{method, selection, averaging}`` of a resolved reduction: the rules its row is labelled by."""
    o = reduction.options
    if o.strategy == "tap":
        method, selection, averaging = tap_rules(reduction.strategy.register)
        return {"method": method, "selection": selection, "averaging": averaging}
    if o.strategy in ORIGINAL_RULES:
        selection, averaging = ORIGINAL_RULES[o.strategy]
        if o.strategy == "asap" and o.mode == "prune":
            averaging = PRUNED[o.llf]
    else:
        scored = o.strategy in NEEDS_SCORER
        if o.mode == "prune":
            selection = "lowest importance" if scored else _score_rule(o.strategy)
            averaging = PRUNED[o.llf] if o.recovery is None else f"{PRUNED[o.llf]}, recovered at α = {o.recovery:g}"
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
