"""What the diagnostic returns: one ``ImageDiagnosis`` per feature map, and a ``Diagnosis`` with
their aggregate (mean ± std over images), the regime of the mean and the settings used."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from pullback_ext.diagnostics.config import DiagnoseConfig, Thresholds
from pullback_ext.diagnostics.regimes import REDUCTION, REGIMES, classify
from pullback_ext.errors import PullbackError


@dataclass
class ImageDiagnosis:
    """Diagnostic of one feature map. Vectors are float64 tensors; ``to_dict`` makes lists of them.

    sigma[r], V[r,N,D] (right singular vectors as token maps, in the features' dtype; None when not
    kept), token_energy[N], importance[N] = imp*, kappa_curve[r] = κ_cap(k) for k = 1..r.
    ``trace_stderr`` and ``kappa_stderr`` are the standard errors of the stochastic T̂ and κ_cap
    (0 when ``trace_method`` is exact).
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
    kappa_stderr: float
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
# the stochastic figures and the per-image fields holding their standard errors
STDERRS = {"trace": "trace_stderr", "kappa_cap": "kappa_stderr"}


@dataclass
class Diagnosis:
    """Per-image diagnostics plus their aggregate.

    aggregate[name] = {"mean", "std", "n"} for every scalar in ``AGGREGATED`` that was computable,
    with "stderr" for T and κ_cap: the standard error of their mean from the estimators' own noise,
    sqrt(Σ_i stderr_i²) / n (0 when exact; "std" is the spread over images);
    ``regime`` / ``method`` come from the mean κ_cap and mean CV; ``settings`` is what
    ``recorded_settings`` makes of the config.
    """

    images: list[ImageDiagnosis]
    aggregate: dict[str, dict[str, float]]
    regime: str
    method: str
    settings: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_images(cls, images: Sequence[ImageDiagnosis], config: DiagnoseConfig) -> "Diagnosis":
        """The diagnosis of ``images`` (in image order) computed with ``config``."""
        agg, regime, method = aggregate(images, config.thresholds)
        return cls(list(images), agg, regime, method, recorded_settings(config, images))

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
            "reduction": REDUCTION[self.regime],
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
    for name, field_name in STDERRS.items():
        stderrs = torch.tensor([float(getattr(d, field_name)) for d in images], dtype=torch.float64)
        agg[name]["stderr"] = float(stderrs.square().sum().sqrt()) / len(images)
    regime = classify(images[0].M, images[0].rank, agg["kappa_cap"]["mean"], agg["cv"]["mean"], thresholds)
    return agg, regime, REGIMES[regime][1]


def recorded_settings(config: DiagnoseConfig, images: Sequence[ImageDiagnosis]) -> dict[str, Any]:
    """``asdict(config)`` with the values actually used: ``rank`` is r = min(rank, M) of the images
    and ``rank_requested`` the config's rank."""
    if not images:
        raise PullbackError("images: expected at least one image diagnosis, got none")
    return {**asdict(config), "rank": images[0].rank, "rank_requested": config.rank}


def r90_note(aggregate_: dict[str, dict[str, float]], num_images: int, rank: int) -> Optional[str]:
    """What a printed r90 cell leaves out, or None: r90 (the fewest directions with κ_cap >= 0.9) is
    ``n/a`` when no image reached 0.9 within the ``rank`` computed directions, and a mean over fewer
    than ``num_images`` images when some did not. ``aggregate_`` as :func:`aggregate` returns it."""
    reached = int(aggregate_["r90"]["n"]) if "r90" in aggregate_ else 0
    if reached == num_images:
        return None
    if reached == 0:
        return f"r90 n/a: κ_cap stays below 0.9 within the r = {rank} directions computed (a larger --rank may reach it)"
    return f"r90: the mean over the {reached} of {num_images} images whose κ_cap reaches 0.9 within r = {rank}"
