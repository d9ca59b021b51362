"""Tiny real architectures and dense Jacobian oracles shared by the probe / linalg / diagnose tests."""

from __future__ import annotations

import math

import torch


def tiny_timm_vit(seed: int = 0, dtype: torch.dtype = torch.float64, depth: int = 3, embed_dim: int = 32, img_size: int = 32, **kwargs):
    """timm VisionTransformer with random weights, patch 8: N = (img/8)² + prefix tokens."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    model = VisionTransformer(img_size=img_size, patch_size=8, embed_dim=embed_dim, depth=depth, num_heads=2, **kwargs)
    return model.to(dtype).eval()


def tiny_dpt(seed: int = 0, dtype: torch.dtype = torch.float64):
    """transformers DPTForDepthEstimation, ViT backbone of 4 layers, hooks at 0..3, 32 px, patch 8.

    Convolutions are re-drawn with unit-gain init so the random head is not numerically flat.
    """
    from transformers import DPTConfig, DPTForDepthEstimation

    torch.manual_seed(seed)
    config = DPTConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, image_size=32,
        patch_size=8, backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 16, 32, 32],
        fusion_hidden_size=16, head_in_index=-1, reassemble_factors=[4, 2, 1, 0.5],
    )
    model = DPTForDepthEstimation(config)
    _unit_gain(model)
    return model.to(dtype).eval()


def tiny_depth_anything(seed: int = 0, dtype: torch.dtype = torch.float64):
    """transformers DepthAnythingForDepthEstimation with a 4-layer DINOv2 backbone, 32 px, patch 8."""
    from transformers import DepthAnythingConfig, DepthAnythingForDepthEstimation, Dinov2Config

    torch.manual_seed(seed)
    backbone = Dinov2Config(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8,
        out_features=["stage1", "stage3", "stage4"], reshape_hidden_states=False,
    )
    config = DepthAnythingConfig(
        backbone_config=backbone, reassemble_hidden_size=32, neck_hidden_sizes=[8, 16, 32],
        fusion_hidden_size=16, reassemble_factors=[4, 2, 1], patch_size=8,
    )
    model = DepthAnythingForDepthEstimation(config)
    _unit_gain(model)
    return model.to(dtype).eval()


def _unit_gain(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) / math.sqrt(fan_in))
                if m.bias is not None:
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))


def images(n: int, size: int = 32, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g).to(dtype)


def dense_jacobian(fn, F: torch.Tensor) -> torch.Tensor:
    """J[M, N·D] of fn: F[1,N,D] -> y[1,M] at one feature map F[N,D], by reverse mode (jacrev)."""
    J = torch.func.jacrev(lambda f: fn(f.unsqueeze(0)).reshape(-1))(F)
    return J.reshape(J.shape[0], -1).detach()


def dense_diagnostics(J: torch.Tensor, rank: int, N: int) -> dict:
    """Exact oracle values from the full SVD of J (κ_cap, CV, imp*, spectral entropy)."""
    _, S, Vh = torch.linalg.svd(J.double(), full_matrices=False)
    lam = S**2
    T = float(lam.sum())
    top = Vh[:rank].reshape(rank, N, -1)
    e = torch.einsum("j,jtd->t", lam[:rank], top**2)
    p = lam[lam > 0] / T
    return {
        "sigma": S,
        "V": Vh[:rank].T,
        "trace": T,
        "kappa": float(lam[:rank].sum()) / T,
        "cv": float(e.std(unbiased=False) / e.mean()),
        "importance": e.sqrt(),
        "r_eff": math.exp(float(-(p * p.log()).sum())),
    }
