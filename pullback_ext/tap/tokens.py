"""Small pieces shared by TAP's deployed (hard) and training (relaxed) block loops."""

from __future__ import annotations

import math

import torch

from pullback_ext.errors import PullbackError


def patch_grid(num_patch: int) -> tuple[int, int]:
    """The square ``(h, w)`` grid of ``num_patch`` patch tokens (the recovery reads 8-neighbours)."""
    side = math.isqrt(num_patch)
    if side * side != num_patch:
        raise PullbackError(f"TAP needs a square patch grid; got {num_patch} patch tokens")
    return side, side


def strip_register(x: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """``x [B, N + 1, D]`` without the task register (at index ``num_prefix``): ``[B, N, D]``."""
    return torch.cat([x[:, :num_prefix], x[:, num_prefix + 1:]], dim=1)


def batch_shares(shares: torch.Tensor) -> list[float]:
    """The shares ``[B, L − j]`` of one batch: their mean over the images (one host read)."""
    return shares.detach().mean(dim=0).tolist()
