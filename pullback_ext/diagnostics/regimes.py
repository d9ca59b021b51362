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


def classify(M: int, rank: int, kappa_cap: float, cv: float, thresholds: Thresholds = Thresholds()) -> str:
    """Regime label (docs/formulas.md §2): 'iv' if M ≤ r, else by κ_cap(r) and CV."""
    if M <= rank:
        return "iv"
    low_rank = kappa_cap >= thresholds.kappa
    localised = cv >= thresholds.cv
    if low_rank:
        return "v" if localised else "ii"
    return "iii" if localised else "i"
