"""The attention sink of a lazy random walk over a ViT's attention, and every token's diffusion
distance to it: the geometry of ASAP (:mod:`pullback_ext.prune.methods.asap`, where the method and
its reading of the paper are described), which the single-stage score ``asap_score``
(:mod:`pullback_ext.prune.strategies`) reads too.
"""

from __future__ import annotations

import torch

ALPHA = 0.5  # laziness of the walk (the reconstruction's α = ½)


def lazy_walk(attentions: list, alpha: float) -> torch.Tensor:
    """``T = P_last ⋯ P_first`` ``[B, K, K]`` (float64) with ``P = α I + (1 − α) A`` for each
    head-averaged attention ``A [B, K, K]`` of ``attentions`` (oldest first)."""
    a0 = attentions[0].double()
    eye = torch.eye(a0.shape[-1], dtype=a0.dtype, device=a0.device)
    t = eye.expand_as(a0)
    for a in attentions:
        t = (alpha * eye + (1.0 - alpha) * a.double()) @ t
    return t


def sink_distances(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sink ``[B]`` (the token with the largest column mass of ``t [B, K, K]``) and every
    token's diffusion distance to it ``[B, K]``."""
    mass = t.sum(dim=1)  # [B, K]
    sink = mass.argmax(dim=1)
    pi = (mass / t.shape[-1]).clamp_min(1e-12)
    t_sink = t[torch.arange(t.shape[0], device=t.device), sink]  # [B, K]
    return sink, ((t - t_sink[:, None, :]) / pi.sqrt()[:, None, :]).norm(dim=-1)
