"""Matrix-free linear algebra on Jacobians: operators, randomized SVD, trace (exact, Hutchinson,
Hutch++, XNysTrace) and SLQ estimators, and the rules that choose between exact and stochastic
methods (``trace_method``, ``svd_method``)."""

from pullback_ext.linalg.dense import DENSE_MAX_BYTES, DenseSpectrum, dense_fits, dense_spectrum, jacobian_transposed
from pullback_ext.linalg.energy import token_energy
from pullback_ext.linalg.operator import DenseOperator, JacobianOperator, LinearOperatorBase, math_attention
from pullback_ext.linalg.orthonormalize import orthonormalize
from pullback_ext.linalg.rsvd import RSVDResult, randomized_svd, subspace_alignment
from pullback_ext.linalg.slq import Quadrature, SpectralEntropy, lanczos_quadrature, slq_effective_rank
from pullback_ext.linalg.spectrum import SVD_METHODS, Spectrum, svd_method, top_spectrum
from pullback_ext.linalg.trace import (
    EXACT_TRACE_MAX,
    TRACE_METHODS,
    TraceEstimate,
    basis_products,
    deflated_xnystrace,
    exact_trace,
    hutchinson,
    hutchpp,
    total_sensitivity,
    trace_method,
)
from pullback_ext.linalg.xnystrace import xnystrace

__all__ = [
    "DENSE_MAX_BYTES",
    "DenseSpectrum",
    "DenseOperator",
    "EXACT_TRACE_MAX",
    "JacobianOperator",
    "LinearOperatorBase",
    "Quadrature",
    "RSVDResult",
    "SVD_METHODS",
    "Spectrum",
    "SpectralEntropy",
    "TRACE_METHODS",
    "TraceEstimate",
    "basis_products",
    "deflated_xnystrace",
    "dense_fits",
    "dense_spectrum",
    "exact_trace",
    "hutchinson",
    "hutchpp",
    "jacobian_transposed",
    "lanczos_quadrature",
    "math_attention",
    "orthonormalize",
    "randomized_svd",
    "slq_effective_rank",
    "subspace_alignment",
    "svd_method",
    "token_energy",
    "top_spectrum",
    "total_sensitivity",
    "trace_method",
    "xnystrace",
]
