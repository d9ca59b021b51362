"""Input builders shared by the op tests (test_ops*.py)."""

from __future__ import annotations

import pytest
import torch

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]

# Tolerances of a compiled result against the float64 reference, per dtype.
TOLERANCE = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.float16: dict(rtol=2e-2, atol=2e-2),
    torch.bfloat16: dict(rtol=5e-2, atol=5e-2),
}


def compiled_dtypes(device: str) -> list[torch.dtype]:
    """The dtypes the compiled kernels cover on ``device``."""
    if device == "cuda":
        return [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    return [torch.float32, torch.float64]


def metric_inputs(B, N, D, r, k, dtype, device, seed=0):
    """U [B,N·D,r], lam [B,r] > 0, v [B,N·D,k]."""
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(B, N * D, r, generator=g, dtype=torch.float64)
    lam = torch.rand(B, r, generator=g, dtype=torch.float64) + 0.1
    v = torch.randn(B, N * D, k, generator=g, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype) for t in (U, lam, v))


def merge_inputs(B, N, D, R, dtype, device, seed=0):
    """x [B,N,D], w [B,N] > 0, src_idx [B,R] distinct, dst_idx [B,R] among the kept tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    w = (torch.rand(B, N, generator=g, dtype=torch.float64) + 0.5).to(device=device, dtype=dtype)
    perms = torch.stack([torch.randperm(N, generator=g) for _ in range(B)])
    src = perms[:, :R]
    kept = perms[:, R:]
    dst = kept.gather(1, torch.randint(0, N - R, (B, R), generator=g))
    return x, w, src.to(device), dst.to(device)


def reinsert_inputs(B, K, R, D, dtype, device, seed=0):
    """kept [B,K,D], kept_idx [B,K], pruned [B,R,D], pruned_idx [B,R] (a random split of 0..K+R-1)."""
    g = torch.Generator().manual_seed(seed)
    perms = torch.stack([torch.randperm(K + R, generator=g) for _ in range(B)])
    kept = torch.randn(B, K, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    pruned = torch.randn(B, R, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    return kept, perms[:, :K].to(device), pruned, perms[:, K:].to(device)
