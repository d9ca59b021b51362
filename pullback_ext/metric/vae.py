"""VAE bottleneck for rich-spectrum probes (docs/formulas.md §3, regime (i)).

A per-token VAE on the features a decoder reads (for instance the concatenated multi-layer DPT
input, F[B,N,D]); the probe then becomes ψ ∘ Dec at the latent z[B,N,d], which the diagnostic
and the SPN treat like any other feature map.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pullback_ext.probes.base import Probe
from pullback_ext.probes.features import Features
from pullback_ext.errors import PullbackError


def _mlp(inp: int, hidden: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inp, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, out))


class FeatureVAE(nn.Module):
    """Per-token VAE: F[B,N,D] <-> z[B,N,latent_dim].

    Features are standardised per channel with statistics set by ``fit_normalization`` (stored as
    buffers, so they travel with the checkpoint); ``decode`` returns features in the original units.
    """

    def __init__(self, dim: int, latent_dim: int, hidden: int = 256) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("latent_dim", latent_dim), ("hidden", hidden)):
            if not isinstance(value, int) or value < 1:
                raise PullbackError(f"{name}: expected a positive int, got {value!r}")
        self.dim, self.latent_dim, self.hidden = dim, latent_dim, hidden
        self.encoder = _mlp(dim, hidden, 2 * latent_dim)
        self.decoder = _mlp(latent_dim, hidden, dim)
        self.register_buffer("feature_mean", torch.zeros(dim))
        self.register_buffer("feature_std", torch.ones(dim))

    def config(self) -> dict:
        return {"dim": self.dim, "latent_dim": self.latent_dim, "hidden": self.hidden}

    @torch.no_grad()
    def fit_normalization(self, F: Tensor) -> None:
        """Set the per-channel mean/std from sample features F[..., D]."""
        self._check(F, self.dim, "F")
        flat = F.reshape(-1, self.dim)
        self.feature_mean.copy_(flat.mean(0))
        self.feature_std.copy_(flat.std(0).clamp_min(1e-6))

    @staticmethod
    def _check(X: Tensor, width: int, name: str) -> None:
        if not isinstance(X, Tensor) or not X.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point torch.Tensor, got {getattr(X, 'dtype', type(X).__name__)}")
        if X.dim() < 2 or X.shape[-1] != width:
            raise PullbackError(f"{name}: expected shape [..., {width}], got {tuple(X.shape)}")

    def encode(self, F: Tensor) -> tuple[Tensor, Tensor]:
        """F[...,D] -> (mean[...,d], logvar[...,d])."""
        self._check(F, self.dim, "F")
        mean, logvar = self.encoder((F - self.feature_mean) / self.feature_std).chunk(2, dim=-1)
        return mean, logvar.clamp(-12.0, 8.0)

    def decode(self, z: Tensor) -> Tensor:
        """z[...,d] -> F̂[...,D] in feature units."""
        self._check(z, self.latent_dim, "z")
        return self.decoder(z) * self.feature_std + self.feature_mean

    def forward(self, F: Tensor, noise: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """F -> (reconstruction F̂, mean, logvar), with z = mean + noise·σ (reparameterisation).

        ``noise`` (standard normal, shaped like the latent) is drawn when not given.
        """
        mean, logvar = self.encode(F)
        if noise is None:
            noise = torch.randn_like(mean)
        elif noise.shape != mean.shape:
            raise PullbackError(f"noise: expected shape {tuple(mean.shape)}, got {tuple(noise.shape)}")
        return self.decode(mean + noise.to(mean.dtype) * (0.5 * logvar).exp()), mean, logvar

    def loss(self, F: Tensor, beta: float = 1e-3, noise: Tensor | None = None) -> tuple[Tensor, dict]:
        """β-VAE loss: standardised reconstruction MSE + β · KL per latent channel."""
        return self.loss_terms(F, *self(F, noise), beta)

    def loss_terms(self, F: Tensor, recon: Tensor, mean: Tensor, logvar: Tensor, beta: float) -> tuple[Tensor, dict]:
        """The loss from a forward pass's outputs (lets a DDP wrapper run the forward)."""
        rec = (((recon - F) / self.feature_std) ** 2).mean()
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
        return rec + beta * kl, {"recon": float(rec.detach()), "kl": float(kl.detach())}


class LatentProbe(Probe):
    """ψ ∘ Dec: the probe map at the VAE latent, z[B,N,d] -> y[B,M].

    ``features(images)`` returns the posterior mean of the base probe's features, with the base
    probe's per-image context (which ``bind`` passes on to it).
    """

    def __init__(self, base: Probe, vae: FeatureVAE) -> None:
        if vae.dim != base.dim:
            raise PullbackError(f"vae: expected a VAE on D={base.dim} features (the probe's dim), got dim={vae.dim}")
        super().__init__(base.layer, base.num_tokens, vae.latent_dim, base.num_prefix_tokens)
        self.base = base
        self.vae = vae

    def features(self, images: Tensor) -> Features:
        return self.latent(self.base.features(images))

    def latent(self, features: Features) -> Features:
        """The base probe's ``Features`` -> z[B,N,d] (posterior mean), with the same context."""
        return Features(self.vae.encode(features.F)[0], features.context)

    @property
    def context_keys(self) -> tuple[str, ...]:
        return self.base.context_keys

    def _bind(self, context: dict[str, Tensor]) -> Probe:
        return LatentProbe(self.base.bind(context), self.vae)

    def forward(self, z: Tensor) -> Tensor:
        self.check_features(z, "z")
        return self.base(self.vae.decode(z))
