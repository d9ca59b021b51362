"""The diagnostic of one feature map: choose the methods, compute the spectrum, derive the statistics."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from pullback_ext.diagnostics.config import DiagnoseConfig
from pullback_ext.diagnostics.regimes import REGIMES, classify
from pullback_ext.diagnostics.results import ImageDiagnosis
from pullback_ext.errors import PullbackError
from pullback_ext.linalg import (
    JacobianOperator,
    LinearOperatorBase,
    Spectrum,
    TraceEstimate,
    slq_effective_rank,
    svd_method,
    token_energy,
    top_spectrum,
    total_sensitivity,
    trace_method,
)


@dataclass
class _Measured:
    """What the Jacobian products of one image give: the top-r spectrum (σ, V, how), the trace
    estimate and r_eff^SLQ (None when skipped)."""

    top: Spectrum
    trace: TraceEstimate
    r_eff_slq: Optional[float]


def _generator(seed: int, index: int) -> torch.Generator:
    # one stream per (seed, image index): results do not depend on batching or sharding
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63))


def choose_methods(op: LinearOperatorBase, config: DiagnoseConfig) -> tuple[str, str]:
    """(trace method, SVD method) for ``op`` under the config's "auto" rules (``pullback_ext.linalg``)."""
    trace = trace_method(op.shape, config.trace)
    return trace, svd_method(op, config.svd, trace)


def spectrum(op: LinearOperatorBase, rank: int, config: DiagnoseConfig, methods: tuple[str, str], generator: torch.Generator) -> _Measured:
    """Top-``rank`` σ and V, the trace T and r_eff^SLQ of ``op`` by ``methods`` (trace, SVD).

    The dense SVD gives T and the full-spectrum r_eff exactly and draws nothing; otherwise the
    sketch, then the trace probes, then the Lanczos probes are drawn from ``generator`` in that order.
    """
    trace, svd = methods
    top = top_spectrum(op, rank, svd, trace, config.oversample, config.power, generator, config.adaptive_tol)
    if top.trace is not None:
        return _Measured(top, TraceEstimate(top.trace, 0.0, "exact"), top.entropy.r_eff)
    energy = float((top.sigma**2).sum())
    est = total_sensitivity(op, trace, config.probes, generator, basis=top.V, energy=energy)
    r_eff = slq_effective_rank(op, config.probes, config.slq_steps, generator).r_eff if config.slq_steps > 0 else None
    return _Measured(top, est, r_eff)


def statistics(measured: _Measured, num_tokens: int) -> dict[str, Any]:
    """The ``ImageDiagnosis`` fields derived from the measurements: κ_cap(r), its standard error and
    its curve, r90, e_t[N], imp*[N], CV, r_eff^trunc, r_eff^SLQ and the tail richness
    r_eff^SLQ / r_eff^trunc. κ_cap's standard error is κ_cap · stderr(T̂) / T̂ (delta method; the
    captured energy Σσ² is exact given the spectrum, so T̂ carries all the noise)."""
    sigma, V, T = measured.top.sigma, measured.top.V, measured.trace.value
    kappa_curve = torch.cumsum(sigma**2, 0) / T if T > 0 else torch.zeros_like(sigma)
    kappa = float(kappa_curve[-1]) if T > 0 else 0.0
    above = (kappa_curve >= 0.9).nonzero()
    e = token_energy(V, sigma.to(V.dtype), num_tokens)
    mean_e = float(e.mean())
    energy = float((sigma**2).sum())
    p = sigma**2 / energy if energy > 0 else torch.zeros_like(sigma)
    p = p[p > 0]
    r_eff_trunc = float(torch.exp(-(p * p.log()).sum())) if p.numel() else 0.0
    r_eff_slq = measured.r_eff_slq
    return dict(
        kappa_cap=kappa,
        kappa_stderr=kappa * measured.trace.stderr / T if T > 0 else 0.0,
        kappa_curve=kappa_curve,
        r90=int(above[0]) + 1 if above.numel() else None,
        token_energy=e,
        importance=e.sqrt(),
        cv=float(e.std(unbiased=False) / mean_e) if mean_e > 0 else 0.0,
        r_eff_trunc=r_eff_trunc,
        r_eff_slq=r_eff_slq,
        tail_richness=(r_eff_slq / r_eff_trunc) if r_eff_slq is not None and r_eff_trunc > 0 else None,
    )


def _check_finite(measured: _Measured, index: int) -> None:
    sigma, est = measured.top.sigma, measured.trace
    if not (torch.isfinite(sigma).all() and math.isfinite(est.value) and math.isfinite(est.stderr)):
        raise PullbackError(f"probe: Jacobian products at image {index} are not finite (sigma={sigma.tolist()}, trace={est.value})")


def _warn_if_kappa_uncertain(index: int, kappa: float, stderr: float) -> None:
    """Warn when the stochastic κ_cap ± 2·stderr leaves [0, 1] (e.g. plain Hutchinson with few probes
    on a J whose top-r subspace holds nearly all the energy: T̂ can then fall below Σσ²). An exact
    κ_cap (stderr 0) never warns: it lies in [0, 1] up to rounding."""
    low, high = kappa - 2 * stderr, kappa + 2 * stderr
    if stderr > 0 and (low < 0 or high > 1):
        warnings.warn(
            f"kappa_cap: image {index} has κ_cap = {kappa:.4f} ± {stderr:.2g}, whose interval κ_cap ± 2·stderr = "
            f"[{low:.4f}, {high:.4f}] leaves [0, 1]; the stochastic trace is too noisy there (more probes, or trace='exact')",
            stacklevel=3,
        )


def diagnose_one(
    fn: Callable[[Tensor], Tensor],
    F: Tensor,
    index: int = 0,
    config: DiagnoseConfig = DiagnoseConfig(),
    keep_vectors: bool = True,
) -> ImageDiagnosis:
    """Diagnostic of ψ = ``fn`` (F[1,N,D] -> y[1,M]) at one feature map F[N,D], image ``index``
    of the run (its random stream; see ``diagnose``). V[r,N,D] is kept with ``keep_vectors``."""
    N, D = F.shape
    op = JacobianOperator(fn, F, chunk_size=config.chunk_size)
    M, P = op.shape
    config.check_rank(P)
    r = min(config.rank, M)
    measured = spectrum(op, r, config, choose_methods(op, config), _generator(config.seed, index))
    _check_finite(measured, index)
    stats = statistics(measured, N)
    _warn_if_kappa_uncertain(index, stats["kappa_cap"], stats["kappa_stderr"])
    regime = classify(M, config.rank, stats["kappa_cap"], stats["cv"], config.thresholds)
    top, est = measured.top, measured.trace
    return ImageDiagnosis(
        index=index, M=M, P=P, N=N, D=D, rank=r, sigma=top.sigma, V=top.V.T.reshape(r, N, D).clone() if keep_vectors else None,
        trace=est.value, trace_stderr=est.stderr, trace_method=est.method, power=top.power, power_defects=top.defects,
        regime=regime, method=REGIMES[regime][1], tangent_passes=op.num_jvp + op.num_vjp, svd_method=top.method, **stats,
    )
