"""The five tractability regimes (docs/formulas.md §2) and the rule that assigns one."""

from __future__ import annotations

from pullback_ext.diagnostics.config import Thresholds

REGIMES = {
    "i": ("rich spectrum", "VAE bottleneck first, then an SPN on the latent"),
    "ii": (
        "low rank, delocalised",
        "SPN with cross-token attention; importance scores are weak, so dense pruning needs LLF + 2-stage",
    ),
    "iii": ("marginal captured energy, localised", "per-token importance head"),
    "iv": ("structurally rank-bounded", "SPN in a controlled setting"),
    "v": ("low rank, localised", "either an SPN or a per-token importance head"),
}


# The token reduction each regime calls for (pullback_ext.prune.methods.importance_tome), from the
# matched-cost comparisons of docs/prune.md ("Which method, by regime"): a head's ranking guards the
# merges where importance is localised and a head ranks it; elsewhere the size-weighted merge cost
# without a head, which no per-token score can improve on there, and for a dense decoder the same cost
# between clusters at a few blocks (importance_cluster: ahead of ATC and ToMe on the depth page).
DENSE = "; for a dense decoder strategy='importance_cluster', head=None"
REDUCTION = {
    "i": "strategy='importance_tome', head=None: per-token importance is delocalised, no head ranks it" + DENSE,
    "ii": "strategy='importance_tome', head=None: per-token importance is delocalised, no head ranks it" + DENSE,
    "iii": "strategy='importance_tome' with an importance head trained at the scored layer",
    "iv": "strategy='importance_tome' with an importance head trained at the scored layer",
    "v": ("strategy='importance_tome' with an importance head where one ranks imp* well (held-out Spearman ρ ≳ 0.8), "
          "else head=None" + DENSE),
}


def classify(M: int, rank: int, kappa_cap: float, cv: float, thresholds: Thresholds = Thresholds()) -> str:
    """Regime label (docs/formulas.md §2): 'iv' if M ≤ r, else by κ_cap(r) and CV."""
    if M <= rank:
        return "iv"
    low_rank = kappa_cap >= thresholds.kappa
    localised = cv >= thresholds.cv
    if low_rank:
        return "v" if localised else "ii"
    return "iii" if localised else "i"
