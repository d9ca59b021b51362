"""Matrix-free linear algebra on Jacobians: operators, randomized SVD, trace and SLQ estimators."""

from pullback_ext.linalg.dense import DENSE_MAX_BYTES, DenseSpectrum, dense_fits, dense_spectrum, jacobian_transposed
from pullback_ext.linalg.energy import token_energy
from pullback_ext.linalg.operator import DenseOperator, JacobianOperator, LinearOperatorBase, math_attention
from pullback_ext.linalg.orthonormalize import orthonormalize
from pullback_ext.linalg.rsvd import RSVDResult, randomized_svd, subspace_alignment
from pullback_ext.linalg.slq import Quadrature, SpectralEntropy, lanczos_quadrature, slq_effective_rank
from pullback_ext.linalg.trace import EXACT_TRACE_MAX, TraceEstimate, basis_products, exact_trace, hutchinson, hutchpp

__all__ = [
    "DENSE_MAX_BYTES",
    "DenseSpectrum",
    "DenseOperator",
    "EXACT_TRACE_MAX",
    "JacobianOperator",
    "LinearOperatorBase",
    "Quadrature",
    "RSVDResult",
    "SpectralEntropy",
    "TraceEstimate",
    "basis_products",
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
    "token_energy",
]
