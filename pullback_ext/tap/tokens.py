"""Small pieces shared by TAP's deployed (hard) and training (relaxed) block loops."""

from __future__ import annotations

import torch


def strip_register(x: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """``x [B, N + 1, D]`` without the task register (at index ``num_prefix``): ``[B, N, D]``."""
    return torch.cat([x[:, :num_prefix], x[:, num_prefix + 1:]], dim=1)


def batch_shares(shares: torch.Tensor) -> list[float]:
    """The shares ``[B, L − j]`` of one batch: their mean over the images (one host read)."""
    return shares.detach().mean(dim=0).tolist()
