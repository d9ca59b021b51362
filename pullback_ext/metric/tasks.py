"""Losses per model kind for the training loop, and their held-out evaluations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from pullback_ext.metric.evaluation import spearman_per_image, summarize
from pullback_ext.metric.losses import (
    energy_loss,
    importance_loss,
    nondegenerate_modes,
    pairing_loss,
    subspace_alignment,
    subspace_loss,
)
from pullback_ext.metric.targets import TargetConfig, compute_targets, image_generator


def _at_least_float32(x: Tensor) -> Tensor:
    """Losses are computed in float32 under mixed precision, in the model's dtype otherwise."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


@dataclass
class SPNTask:
    """L_sub + L_en (+ optionally ``w_order`` × the pairing loss) against per-image targets: cached
    (batch has V, sigma) or, when ``probe`` is given, computed on the fly with a fresh sketch per
    (step, image). The pairing term is off by default: on the demo backbone it slowed the
    subspace fit several-fold."""

    targets: TargetConfig
    probe: Optional[Callable[[Tensor], Tensor]] = None
    degenerate_ratio: float = 1.05
    w_order: float = 0.0
    kind: str = "spn"

    def batch_targets(self, batch: dict[str, Tensor], indices: Tensor, step: int) -> tuple[Tensor, Tensor]:
        if self.probe is None:
            return batch["V"], batch["sigma"]
        F = batch["features"].detach()
        t = compute_targets(self.probe, F, self.targets, stream=[(step, int(i)) for i in indices])
        return t["V"].to(F.dtype), t["sigma"].to(F.dtype)

    def loss(self, model: nn.Module, batch: dict[str, Tensor], indices: Tensor, step: int) -> tuple[Tensor, dict[str, float]]:
        V, sigma = self.batch_targets(batch, indices, step)
        U, lam = model(batch["features"])
        m = V.shape[-1]
        l_sub = subspace_loss(_at_least_float32(U), V)
        mask = nondegenerate_modes(sigma, m, self.degenerate_ratio)
        l_en = energy_loss(_at_least_float32(lam[:, :m]), sigma[:, :m].pow(2), mask)
        metrics = {"l_sub": float(l_sub.detach()), "l_en": float(l_en.detach()), "alignment": 1.0 - float(l_sub.detach())}
        loss = l_sub + l_en
        if self.w_order:
            l_order = pairing_loss(_at_least_float32(U), V, mask)
            loss = loss + self.w_order * l_order
            metrics["l_order"] = float(l_order.detach())
        return loss, metrics


@torch.no_grad()
def evaluate_spn(model: nn.Module, features: Tensor, V: Tensor, batch_size: int = 16) -> dict:
    """Held-out subspace alignment ‖UᵀV‖²/m per image: mean, std, ... and ``per_image`` (so that
    two runs on the same held-out images can be compared image by image)."""
    values = []
    for start in range(0, features.shape[0], batch_size):
        U, _ = model(features[start : start + batch_size])
        values.append(subspace_alignment(U.double(), V[start : start + batch_size].double()))
    alignment = torch.cat(values)
    return {**summarize(alignment), "per_image": [float(a) for a in alignment]}


@dataclass
class HeadTask:
    """Log-space regression + w_rank × ranking against ``batch[target]`` (imp*, block norms, or
    the SPN's imp_θ for distillation)."""

    target: str = "importance"
    w_rank: float = 0.5
    kind: str = "head"

    def loss(self, model: nn.Module, batch: dict[str, Tensor], indices: Tensor, step: int) -> tuple[Tensor, dict[str, float]]:
        scores = _at_least_float32(model(batch["features"]))
        loss = importance_loss(scores, batch[self.target], self.w_rank)
        return loss, {}


@torch.no_grad()
def evaluate_head(model: nn.Module, features: Tensor, target: Tensor, batch_size: int = 32) -> dict:
    """Per-image Spearman ρ of the head's scores against ``target`` over held-out images."""
    scores = torch.cat([model(features[s : s + batch_size]) for s in range(0, features.shape[0], batch_size)])
    rho = spearman_per_image(scores, target)
    return {**summarize(rho), "per_image": [float(r) for r in rho]}


@dataclass
class VAETask:
    """β-VAE loss on features; the noise of image i at step s is fixed by (seed, s, i)."""

    beta: float = 1e-3
    seed: int = 0
    kind: str = "vae"

    def loss(self, model: nn.Module, batch: dict[str, Tensor], indices: Tensor, step: int) -> tuple[Tensor, dict[str, float]]:
        F = batch["features"]
        vae = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        noise = torch.stack(
            [torch.randn(F.shape[1], vae.latent_dim, generator=image_generator(self.seed, 3, step, int(i)), dtype=torch.float64) for i in indices]
        ).to(F.device, F.dtype)
        return vae.loss_terms(F, *model(F, noise), self.beta)
