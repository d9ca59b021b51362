"""Temporary model modes a probe map needs, always restored afterwards (also on errors):
evaluation mode (a probe map must be deterministic: no dropout, no batch-norm updates) and math
attention (forward-mode AD, i.e. JVPs, has no rule for fused attention kernels)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from pullback_ext.linalg.operator import math_attention


@contextlib.contextmanager
def evaluation(model: torch.nn.Module) -> Iterator[None]:
    """Every submodule in eval mode within the block; each one's training flag restored after."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for m, flag in flags:
            m.training = flag


@contextlib.contextmanager
def jvp_friendly(model: torch.nn.Module) -> Iterator[None]:
    """Within the block: eval mode, timm attention modules on their explicit (non-fused) path, and
    ``scaled_dot_product_attention`` on its math kernel (transformers' SDPA attention)."""
    fused = [(m, m.fused_attn) for m in model.modules() if isinstance(getattr(m, "fused_attn", None), bool)]
    try:
        for m, _ in fused:
            m.fused_attn = False
        with evaluation(model), math_attention():
            yield
    finally:
        for m, flag in fused:
            m.fused_attn = flag
