"""The diagnostic's settings: one frozen ``DiagnoseConfig``, validated once when it is built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from pullback_ext.errors import PullbackError
from pullback_ext.linalg.spectrum import SVD_METHODS
from pullback_ext.linalg.trace import TRACE_METHODS


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Thresholds:
    """Regime boundaries: κ_cap(r) ≥ ``kappa`` (in [0, 1]) is low rank; CV ≥ ``cv`` (≥ 0) is localised."""

    kappa: float = 0.9
    cv: float = 1.0

    def __post_init__(self) -> None:
        if not _is_real(self.kappa) or not 0 <= self.kappa <= 1:
            raise PullbackError(f"thresholds.kappa: expected a number in [0, 1], got {self.kappa!r}")
        if not _is_real(self.cv) or self.cv < 0:
            raise PullbackError(f"thresholds.cv: expected a number >= 0, got {self.cv!r}")


_INT_FIELDS = (("rank", 1), ("oversample", 0), ("power", 0), ("probes", 2), ("slq_steps", 0), ("seed", 0))


@dataclass(frozen=True)
class DiagnoseConfig:
    """What ``diagnose`` computes and how (docs/formulas.md §2); every field is checked when the config is built.

    rank: r, the captured subspace (κ_cap(r), CV, imp*); must be < P = N·D; capped at M (the
        diagnosis records the rank used and the one requested).
    oversample, power: randomized-SVD sketch of r + ``oversample`` columns and ``power`` rounds.
    probes: test vectors of the stochastic trace and SLQ (≥ 2, for a standard error): Rademacher
        probes for Hutchinson / Hutch++ (one JVP each), Gaussian ones for XNysTrace (one JVP and
        one VJP each; at most min(M, P)).
    slq_steps: Lanczos steps for r_eff^SLQ (0 skips it; with the dense SVD r_eff is exact and free).
    trace: "auto", "exact", "hutchinson", "hutch++" or "xnystrace" (rule:
        ``pullback_ext.linalg.trace_method``: exact when min(M, P) ≤ 512, else XNysTrace).
    svd: "auto", "randomized" or "dense" (rule: ``pullback_ext.linalg.svd_method``).
    seed: every random draw of image i comes from a generator seeded by (seed, i).
    chunk_size: tangents per vmap call (bounds memory); None runs them all at once.
    adaptive_tol: if set (in (0, 1)), power rounds continue until the subspace defect is below it.
    thresholds: regime boundaries.
    """

    rank: int = 20
    oversample: int = 10
    power: int = 2
    probes: int = 100
    slq_steps: int = 30
    trace: str = "auto"
    svd: str = "auto"
    seed: int = 0
    chunk_size: Optional[int] = 32
    adaptive_tol: Optional[float] = None
    thresholds: Thresholds = field(default_factory=Thresholds)

    def __post_init__(self) -> None:
        for name, low in _INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise PullbackError(f"{name}: expected an int >= {low}, got {value!r}")
        if self.trace not in TRACE_METHODS:
            raise PullbackError(f"trace: expected one of {TRACE_METHODS}, got {self.trace!r}")
        if self.svd not in SVD_METHODS:
            raise PullbackError(f"svd: expected one of {SVD_METHODS}, got {self.svd!r}")
        if self.chunk_size is not None and (not _is_int(self.chunk_size) or self.chunk_size < 1):
            raise PullbackError(f"chunk_size: expected a positive int or None, got {self.chunk_size!r}")
        if self.adaptive_tol is not None and (not _is_real(self.adaptive_tol) or not 0 < self.adaptive_tol < 1):
            raise PullbackError(f"adaptive_tol: expected a number in (0, 1) or None, got {self.adaptive_tol!r}")
        if not isinstance(self.thresholds, Thresholds):
            raise PullbackError(f"thresholds: expected a Thresholds, got {type(self.thresholds).__name__}")

    def check_rank(self, P: int) -> None:
        """Raise unless r < P = N·D, the dimension of the feature space."""
        if self.rank >= P:
            raise PullbackError(f"rank: expected r < P = N·D = {P}, got {self.rank}")
