"""The tractability diagnostic: spectrum, captured energy, spatial concentration and regime of a
probe map at given feature maps (SPEC §2).

``diagnose(probe, F)`` returns a ``Diagnosis``: one ``ImageDiagnosis`` per feature map and an
aggregate (mean ± std over images) with the regime of the mean.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from pullback_ext.errors import PullbackError

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

TRACE_METHODS = ("auto", "exact", "hutchinson", "hutch++")
SVD_METHODS = ("auto", "randomized", "dense")


@dataclass(frozen=True)
class Thresholds:
    """Regime boundaries: κ_cap(r) ≥ ``kappa`` is low rank; CV ≥ ``cv`` is localised."""

    kappa: float = 0.9
    cv: float = 1.0


def classify(M: int, rank: int, kappa_cap: float, cv: float, thresholds: Thresholds = Thresholds()) -> str:
    """Regime label (SPEC §2): 'iv' if M ≤ r, else by κ_cap(r) and CV."""
    if M <= rank:
        return "iv"
    low_rank = kappa_cap >= thresholds.kappa
    localised = cv >= thresholds.cv
    if low_rank:
        return "v" if localised else "ii"
    return "iii" if localised else "i"


@dataclass
class ImageDiagnosis:
    """Diagnostic of one feature map. Vectors are float64 tensors; ``to_dict`` makes lists of them.

    sigma[r], V[r,N,D] (right singular vectors as token maps, in the features' dtype; None when not
    kept), token_energy[N], importance[N] = imp*, kappa_curve[r] = κ_cap(k) for k = 1..r.
    ``svd_method``: ``randomized`` (sketch and power rounds) or ``dense`` (J formed from the exact
    trace's products: σ, V, trace and r_eff_slq are then exact and ``power`` is 0).
    """

    index: int
    M: int
    P: int
    N: int
    D: int
    rank: int
    sigma: Tensor
    V: Optional[Tensor]
    trace: float
    trace_stderr: float
    trace_method: str
    kappa_cap: float
    kappa_curve: Tensor
    token_energy: Tensor
    importance: Tensor
    cv: float
    r_eff_trunc: float
    r_eff_slq: Optional[float]
    tail_richness: Optional[float]
    r90: Optional[int]
    power: int
    power_defects: list[float]
    regime: str
    method: str
    tangent_passes: int
    svd_method: str = "randomized"

    def to_dict(self, include_vectors: bool = False) -> dict[str, Any]:
        """JSON-ready dict; V (r·N·D numbers) only with ``include_vectors``."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if key == "V" and (not include_vectors or value is None):
                continue
            out[key] = value.tolist() if isinstance(value, Tensor) else value
        out["regime_name"] = REGIMES[self.regime][0]
        return out


AGGREGATED = ("trace", "kappa_cap", "cv", "r_eff_trunc", "r_eff_slq", "tail_richness", "r90")


@dataclass
class Diagnosis:
    """Per-image diagnostics plus their aggregate.

    aggregate[name] = {"mean", "std", "n"} for every scalar in ``AGGREGATED`` that was computable;
    ``regime`` / ``method`` come from the mean κ_cap and mean CV.
    """

    images: list[ImageDiagnosis]
    aggregate: dict[str, dict[str, float]]
    regime: str
    method: str
    settings: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> ImageDiagnosis:
        return self.images[i]

    def to_dict(self, include_vectors: bool = False) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "aggregate": self.aggregate,
            "regime": self.regime,
            "regime_name": REGIMES[self.regime][0],
            "method": self.method,
            "images": [d.to_dict(include_vectors) for d in self.images],
        }

    def to_json(self, include_vectors: bool = False, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(include_vectors), **kwargs)


def aggregate(images: Sequence[ImageDiagnosis], thresholds: Thresholds = Thresholds()) -> tuple[dict, str, str]:
    """(aggregate dict, regime, method) over per-image diagnostics, in image order."""
    if not images:
        raise PullbackError("images: expected at least one image diagnosis, got none")
    agg: dict[str, dict[str, float]] = {}
    for name in AGGREGATED:
        values = torch.tensor([float(getattr(d, name)) for d in images if getattr(d, name) is not None], dtype=torch.float64)
        if values.numel():
            std = float(values.std(unbiased=True)) if values.numel() > 1 else 0.0
            agg[name] = {"mean": float(values.mean()), "std": std, "n": int(values.numel())}
    regime = classify(images[0].M, images[0].rank, agg["kappa_cap"]["mean"], agg["cv"]["mean"], thresholds)
    return agg, regime, REGIMES[regime][1]


def _check_settings(rank, oversample, power, probes, slq_steps, trace, seed, chunk_size, svd="auto") -> None:
    for name, value, low in (
        ("rank", rank, 1),
        ("oversample", oversample, 0),
        ("power", power, 0),
        ("probes", probes, 2),
        ("slq_steps", slq_steps, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise PullbackError(f"{name}: expected an int >= {low}, got {value!r}")
    if trace not in TRACE_METHODS:
        raise PullbackError(f"trace: expected one of {TRACE_METHODS}, got {trace!r}")
    if svd not in SVD_METHODS:
        raise PullbackError(f"svd: expected one of {SVD_METHODS}, got {svd!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise PullbackError(f"seed: expected a non-negative int, got {seed!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise PullbackError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")


def _generator(seed: int, index: int) -> torch.Generator:
    # one stream per (seed, image index): results do not depend on batching or sharding
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63))


def diagnose_one(
    fn: Callable[[Tensor], Tensor],
    F: Tensor,
    index: int = 0,
    rank: int = 20,
    oversample: int = 10,
    power: int = 2,
    probes: int = 100,
    slq_steps: int = 30,
    trace: str = "auto",
    seed: int = 0,
    chunk_size: Optional[int] = 32,
    adaptive_tol: Optional[float] = None,
    thresholds: Thresholds = Thresholds(),
    keep_vectors: bool = True,
    svd: str = "auto",
) -> ImageDiagnosis:
    """Diagnostic of ψ = ``fn`` at one feature map F[N,D] (see ``diagnose``)."""
    from pullback_ext.linalg import (
        EXACT_TRACE_MAX,
        JacobianOperator,
        TraceEstimate,
        dense_fits,
        dense_spectrum,
        exact_trace,
        hutchinson,
        hutchpp,
        randomized_svd,
        slq_effective_rank,
        token_energy,
    )

    N, D = F.shape
    op = JacobianOperator(fn, F, chunk_size=chunk_size)
    M, P = op.shape
    if rank >= P:
        raise PullbackError(f"rank: expected r < P = N·D = {P}, got {rank}")
    r = min(rank, M)
    gen = _generator(seed, index)
    method = "exact" if trace == "exact" or (trace == "auto" and min(M, P) <= EXACT_TRACE_MAX) else trace
    if method == "auto":
        method = "hutch++"
    if svd == "auto":
        svd = "dense" if method == "exact" and dense_fits(op) else "randomized"
    elif svd == "dense" and not dense_fits(op):
        raise PullbackError(f"svd: 'dense' needs J [{M}, {P}] to fit in 1 GiB; use 'randomized'")
    r_eff_slq: Optional[float] = None
    if svd == "dense":
        dense = dense_spectrum(op, r)
        V, sigma, power_run, defects = dense.V, dense.sigma[:r], 0, []
        est = TraceEstimate(dense.trace, 0.0, "exact")
        r_eff_slq = dense.entropy.r_eff
    else:
        rsvd = randomized_svd(op, r, oversample, power, gen, adaptive_tol)
        V, sigma, power_run, defects = rsvd.V, rsvd.sigma.double(), rsvd.power, rsvd.defects
    energy = float((sigma**2).sum())
    if svd == "randomized":
        if method == "exact":
            est = exact_trace(op)
        elif method == "hutchinson":
            est = hutchinson(op, probes, gen)
        else:
            est = hutchpp(op, V, probes, gen, energy=energy)
        if slq_steps > 0:
            r_eff_slq = slq_effective_rank(op, probes, slq_steps, gen).r_eff
    T = est.value
    if not (torch.isfinite(sigma).all() and math.isfinite(T) and math.isfinite(est.stderr)):
        raise PullbackError(f"probe: Jacobian products at image {index} are not finite (sigma={sigma.tolist()}, trace={T})")
    kappa_curve = torch.cumsum(sigma**2, 0) / T if T > 0 else torch.zeros_like(sigma)
    kappa = float(kappa_curve[-1]) if T > 0 else 0.0
    above = (kappa_curve >= 0.9).nonzero()
    r90 = int(above[0]) + 1 if above.numel() else None

    e = token_energy(V, sigma.to(V.dtype), N)
    mean_e = float(e.mean())
    cv = float(e.std(unbiased=False) / mean_e) if mean_e > 0 else 0.0
    p = sigma**2 / energy if energy > 0 else torch.zeros_like(sigma)
    p = p[p > 0]
    r_eff_trunc = float(torch.exp(-(p * p.log()).sum())) if p.numel() else 0.0

    regime = classify(M, rank, kappa, cv, thresholds)
    return ImageDiagnosis(
        index=index,
        M=M,
        P=P,
        N=N,
        D=D,
        rank=r,
        sigma=sigma,
        V=V.T.reshape(r, N, D).clone() if keep_vectors else None,
        trace=T,
        trace_stderr=est.stderr,
        trace_method=est.method,
        kappa_cap=kappa,
        kappa_curve=kappa_curve,
        token_energy=e,
        importance=e.sqrt(),
        cv=cv,
        r_eff_trunc=r_eff_trunc,
        r_eff_slq=r_eff_slq,
        tail_richness=(r_eff_slq / r_eff_trunc) if r_eff_slq is not None and r_eff_trunc > 0 else None,
        r90=r90,
        power=power_run,
        power_defects=defects,
        regime=regime,
        method=REGIMES[regime][1],
        tangent_passes=op.num_jvp + op.num_vjp,
        svd_method=svd,
    )


def diagnose(
    probe: Callable[[Tensor], Tensor],
    F: Tensor,
    rank: int = 20,
    oversample: int = 10,
    power: int = 2,
    probes: int = 100,
    slq_steps: int = 30,
    trace: str = "auto",
    seed: int = 0,
    chunk_size: Optional[int] = 32,
    adaptive_tol: Optional[float] = None,
    thresholds: Thresholds = Thresholds(),
    indices: Optional[Sequence[int]] = None,
    progress: bool = False,
    keep_vectors: bool = True,
    svd: str = "auto",
) -> Diagnosis:
    """Matrix-free diagnostic of the probe map ψ (F[B,N,D] -> y[B,M]) at each feature map.

    Args:
        probe: a ``Probe`` (its ``for_image(i)`` is used for image i) or any callable F[B,N,D] -> y[B,M].
        F: [N,D] or [B,N,D] feature maps (e.g. ``probe.features(images)``).
        rank: r, the captured subspace (κ_cap(r), CV, imp*); must be < P = N·D; capped at M.
        oversample, power: randomized-SVD sketch r + oversample and q power rounds.
        probes: Rademacher probes for Hutchinson / Hutch++ and SLQ.
        slq_steps: Lanczos steps for r_eff^SLQ (0 skips it; with the dense SVD r_eff is exact and free).
        trace: "auto" (exact when min(M, P) ≤ 512, else Hutch++), "exact", "hutchinson", "hutch++".
        svd: "auto" (dense whenever the trace is exact and J fits in 1 GiB, else randomized),
            "randomized" (sketch + ``power`` rounds) or "dense": the min(M, P) products of an exact
            trace already form J, so one small float64 eigendecomposition gives σ, V, the trace
            and the full-spectrum r_eff exactly, with no power rounds or Lanczos probes.
        seed: every random draw of image i comes from a generator seeded by (seed, indices[i]).
        chunk_size: tangents per vmap call (bounds memory).
        adaptive_tol: if set, power rounds continue until the subspace defect falls below it.
        thresholds: regime boundaries.
        indices: global image indices (default 0..B-1), so shards reproduce the single-run streams.
        progress: show a progress bar.
        keep_vectors: keep V[r,N,D] of every image (r·N·D numbers each).
    """
    if not isinstance(F, Tensor):
        raise TypeError(f"F: expected a torch.Tensor [B,N,D] or [N,D], got {type(F).__name__}")
    if F.dim() == 2:
        F = F.unsqueeze(0)
    if F.dim() != 3 or F.shape[0] < 1:
        raise PullbackError(f"F: expected shape [B,N,D] or [N,D], got {tuple(F.shape)}")
    if not F.is_floating_point():
        raise TypeError(f"F: expected a floating-point tensor, got dtype {F.dtype}")
    check = getattr(probe, "check_features", None)
    if check is not None:
        check(F)
    _check_settings(rank, oversample, power, probes, slq_steps, trace, seed, chunk_size, svd)
    if not isinstance(thresholds, Thresholds):
        raise TypeError(f"thresholds: expected a Thresholds, got {type(thresholds).__name__}")
    if indices is None:
        indices = list(range(F.shape[0]))
    if len(indices) != F.shape[0]:
        raise PullbackError(f"indices: expected {F.shape[0]} indices (one per feature map), got {len(indices)}")

    from tqdm.auto import tqdm

    per_image = []
    for b in tqdm(range(F.shape[0]), desc="diagnose", unit="image", disable=not progress):
        fn = probe.for_image(b) if hasattr(probe, "for_image") else probe
        per_image.append(
            diagnose_one(
                fn, F[b], int(indices[b]), rank, oversample, power, probes, slq_steps, trace, seed, chunk_size, adaptive_tol,
                thresholds, keep_vectors, svd,
            )
        )
    agg, regime, method = aggregate(per_image, thresholds)
    settings = dict(
        rank=rank,
        oversample=oversample,
        power=power,
        probes=probes,
        slq_steps=slq_steps,
        trace=trace,
        svd=svd,
        seed=seed,
        adaptive_tol=adaptive_tol,
        thresholds=asdict(thresholds),
    )
    return Diagnosis(per_image, agg, regime, method, settings)
