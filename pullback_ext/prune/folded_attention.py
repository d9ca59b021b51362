"""Proportional attention folded into the dot product, so that SDPA keeps its fast kernels.

Proportional attention adds ``log s_j`` (the size of key token ``j``) to every attention logit. As
an additive float ``attn_mask`` it rules out FlashAttention. The bias is per key (rank one), so it
folds exactly into one extra head channel: ``q̃ = [q, 1]``, ``k̃ = [k, log s / scale]``, ``ṽ = [v, 0]``
give ``scale · q̃·k̃ = scale · q·k + log s``; q, k and v are zero-padded to a head dim that is a
multiple of 8 (what the fused kernels accept), the softmax scale is passed explicitly (SDPA's
default would be that of the padded width) and the output is sliced back.

``prop_attn="folded"`` selects it for the single-stage merges of a timm ``VisionTransformer``
whose blocks are timm's standard ``Block`` and ``Attention`` (checked when patching); the mask form
stays the default, and the two agree to rounding (tested).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pullback_ext.errors import PullbackError


class FoldedSizes(NamedTuple):
    """Proportional attention to apply by folding: ``log_sizes [B, K]`` of the current tokens."""

    log_sizes: torch.Tensor

    def as_mask(self) -> torch.Tensor:
        """The same bias as an additive mask ``[B, 1, 1, K]``."""
        return self.log_sizes[:, None, None, :]


def folded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_sizes: torch.Tensor, scale: float,
                multiple: int = 8) -> torch.Tensor:
    """``softmax(scale·q kᵀ + log s) v`` as one maskless SDPA call. ``q, k, v [B, H, K, d]``,
    ``log_sizes [B, K]``; returns ``[B, H, K, d]``."""
    b, h, n, d = q.shape
    width = math.ceil((d + 1) / multiple) * multiple
    pad = width - d - 1
    column = (log_sizes / scale).to(k.dtype)[:, None, :, None].expand(b, h, n, 1)
    q_t = F.pad(torch.cat([q, torch.ones_like(q[..., :1])], dim=-1), (0, pad))
    k_t = F.pad(torch.cat([k, column], dim=-1), (0, pad))
    out = F.scaled_dot_product_attention(q_t, k_t, F.pad(v, (0, width - d)), scale=scale)
    return out[..., :d]


def check_foldable(blocks) -> None:
    """Raise unless every block is timm's standard ``Block`` with timm's ``Attention`` (whose forward
    :func:`folded_attention` mirrors)."""
    from timm.layers import Attention
    from timm.models.vision_transformer import Block

    for i, block in enumerate(blocks):
        attn = getattr(block, "attn", None)
        if not (type(block).forward is Block.forward and isinstance(attn, Attention) and type(attn).forward is Attention.forward):
            raise PullbackError(f"prop_attn='folded' needs timm's standard Block and Attention; block {i} is "
                                f"{type(block).__name__} with {type(attn).__name__} (use prop_attn=True)")


def folded_attention(attn, x: torch.Tensor, log_sizes: torch.Tensor) -> torch.Tensor:
    """timm ``Attention.forward`` on ``x [B, K, C]`` (eval mode) with the log-size bias folded in."""
    b, n, _ = x.shape
    gate = attn.gate(x).sigmoid() if getattr(attn, "gate", None) is not None else None
    q, k, v = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    out = folded_sdpa(attn.q_norm(q), attn.k_norm(k), v, log_sizes, float(attn.scale))
    out = attn.norm(out.transpose(1, 2).reshape(b, n, -1))
    if gate is not None:
        out = out * gate
    return attn.proj_drop(attn.proj(out))


def folded_block(block, x: torch.Tensor, sizes: FoldedSizes) -> torch.Tensor:
    """A timm ``Block`` on ``x [B, K, D]`` with proportional attention folded into its attention."""
    x = x + block.drop_path1(block.ls1(folded_attention(block.attn, block.norm1(x), sizes.log_sizes)))
    return x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))
