"""The ``oracle`` strategy's scorer: imp* of the probe map at the stage layer (docs/formulas.md §2).

``imp*(t) = sqrt(Σ_{j≤r} σ_j² ‖v_j^(t)‖²)`` from a randomized SVD of the probe's Jacobian, computed
per image by :func:`pullback_ext.metric.targets.compute_targets`. Expensive (JVP/VJP sweeps per
image): an upper reference for the learned importance, not a deployable rule. It scores the full
token set, so it serves single-stage schedules (or the first stage).
"""

from __future__ import annotations

import torch


class OracleScorer:
    """``scorer(F [B, N, D]) -> imp* [B, N]`` for a probe whose input is ``F``.

    ``probe``: a :class:`pullback_ext.probes.Probe` at layer ``stage - 1`` (its features are the
    output of that block, i.e. the input of the stage's block). ``prepare(images)`` takes the
    per-image context of the batch about to be scored (e.g. the demo depth probe's frozen early
    hooks) for the probes that read one.
    """

    def __init__(self, probe, rank: int = 20, power: int = 2, seed: int = 0):
        from pullback_ext.metric.targets import TargetConfig

        self.probe = probe
        self.config = TargetConfig(mode="randnla", rank=rank, power=power, seed=seed, keep_basis=False)
        self.context: dict[str, torch.Tensor] = {}

    def prepare(self, images: torch.Tensor) -> None:
        if self.probe.context_keys:
            with torch.no_grad():
                self.context = self.probe.features(images).context

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        from pullback_ext.metric.targets import compute_targets
        from pullback_ext.probes.features import Features

        with torch.enable_grad():
            inputs = Features(features.detach(), self.context)
            return compute_targets(self.probe, inputs, self.config)["importance"].to(features.dtype)
