"""Top-r spectrum of J by the method its shape allows (``svd_method``, run by ``top_spectrum``):
dense (exact, from the basis products an exact trace needs anyway) or the randomized SVD."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from pullback_ext.errors import PullbackError
from pullback_ext.linalg.dense import DENSE_MAX_BYTES, dense_fits, dense_spectrum
from pullback_ext.linalg.operator import LinearOperatorBase
from pullback_ext.linalg.rsvd import randomized_svd
from pullback_ext.linalg.slq import SpectralEntropy
from pullback_ext.linalg.trace import trace_method

SVD_METHODS = ("auto", "randomized", "dense")


@dataclass
class Spectrum:
    """sigma[r] (float64, descending) and V[P,r] (right singular vectors, the operator's dtype),
    ``method`` that produced them, the power rounds run and their subspace defects (randomized);
    with the dense method also the exact ``trace`` Σ σ² and the full-spectrum ``entropy``."""

    sigma: Tensor
    V: Tensor
    method: str
    power: int = 0
    defects: list[float] = field(default_factory=list)
    trace: Optional[float] = None
    entropy: Optional[SpectralEntropy] = None


def svd_method(op: LinearOperatorBase, method: str = "auto", trace: str = "auto") -> str:
    """The SVD ``top_spectrum`` runs for ``op`` when asked for ``method``, next to a trace ``trace``.

    "auto" is "dense" when the trace is exact (``trace_method(op.shape, trace)``: its min(M, P)
    basis products already form J) and J fits in ``DENSE_MAX_BYTES`` (1 GiB), else "randomized".
    "dense" on a J that does not fit is an error; "randomized" is returned as given.
    """
    if method not in SVD_METHODS:
        raise PullbackError(f"svd: expected one of {SVD_METHODS}, got {method!r}")
    if method == "auto":
        return "dense" if trace_method(op.shape, trace) == "exact" and dense_fits(op) else "randomized"
    if method == "dense" and not dense_fits(op):
        M, P = op.shape
        raise PullbackError(f"svd: 'dense' needs J [{M}, {P}] to fit in {DENSE_MAX_BYTES >> 30} GiB; use 'randomized'")
    return method


def top_spectrum(
    op: LinearOperatorBase,
    rank: int,
    method: str = "auto",
    trace: str = "auto",
    oversample: int = 10,
    power: int = 2,
    generator: Optional[torch.Generator] = None,
    adaptive_tol: Optional[float] = None,
) -> Spectrum:
    """Top-``rank`` singular values and right singular vectors of J by ``svd_method(op, method, trace)``.

    The randomized SVD sketches r + ``oversample`` columns from ``generator`` and runs ``power``
    rounds (or, with ``adaptive_tol``, until the subspace defect falls below it); the dense method
    draws nothing and is exact.
    """
    if svd_method(op, method, trace) == "dense":
        dense = dense_spectrum(op, rank)
        return Spectrum(dense.sigma[:rank], dense.V, "dense", trace=dense.trace, entropy=dense.entropy)
    rsvd = randomized_svd(op, rank, oversample, power, generator, adaptive_tol)
    return Spectrum(rsvd.sigma.double(), rsvd.V, "randomized", rsvd.power, rsvd.defects)
