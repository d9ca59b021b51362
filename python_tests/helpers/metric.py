"""Small real architectures and dense oracles shared by the metric-learning tests."""

from __future__ import annotations

import torch


def tiny_vit(seed: int = 0, dtype: torch.dtype = torch.float64, depth: int = 3, embed_dim: int = 16, img_size: int = 32):
    """A timm VisionTransformer with random weights: N = (img/8)² + 1 tokens, D = embed_dim."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    model = VisionTransformer(img_size=img_size, patch_size=8, embed_dim=embed_dim, depth=depth, num_heads=2, num_classes=0)
    return model.to(dtype).eval()


def head_probe(model, layer: int, outputs: int, seed: int = 1):
    """CLS embedding followed by a fixed random L[outputs, D]: a rank-bounded probe (M = outputs)."""
    from pullback_ext.probes import from_timm

    g = torch.Generator().manual_seed(seed)
    L = torch.randn(outputs, model.embed_dim, generator=g, dtype=torch.float64) / model.embed_dim**0.5
    return from_timm(model, layer, output="cls", output_transform=L.to(next(model.parameters()).dtype))


def random_features(probe, n: int, seed: int, img_size: int = 32) -> torch.Tensor:
    """F[n,N,D] of random-noise images through the probe's backbone."""
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 3, img_size, img_size, generator=g, dtype=torch.float64)
    dtype = next(probe.parameters()).dtype
    return probe.features(images.to(dtype)).F


def dense_jacobian(probe, F: torch.Tensor) -> torch.Tensor:
    """J[M,P] of the probe at one feature map F[N,D], by reverse mode over all outputs."""
    from pullback_ext.linalg import math_attention

    with math_attention():
        J = torch.func.jacrev(lambda f: probe(f.unsqueeze(0)).reshape(-1))(F)
    return J.reshape(J.shape[0], -1).detach()


def dense_importance(J: torch.Tensor, rank: int, num_tokens: int) -> torch.Tensor:
    """imp*(t) = sqrt(Σ_{j<=rank} σ_j² ‖v_j^(t)‖²) from the dense SVD."""
    _, S, Vh = torch.linalg.svd(J.double(), full_matrices=False)
    V = Vh[:rank].T
    return (V.pow(2) * S[:rank].pow(2)).view(num_tokens, -1, rank).sum((1, 2)).sqrt()


class Killed(Exception):
    """Raised by :func:`kill_at` to simulate a killed training run."""


def kill_at(stop):
    """An ``on_step`` hook that interrupts training after step ``stop``."""
    def hook(step):
        if step == stop:
            raise Killed
    return hook
