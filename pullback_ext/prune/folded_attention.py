"""Proportional attention folded into the dot product, so that SDPA keeps its fast kernels.

Proportional attention adds ``log s_j`` (the size of key token ``j``) to every attention logit. As
an additive float ``attn_mask`` it rules out FlashAttention. The bias is per key (rank one), so it
folds exactly into one extra head channel: ``q̃ = [q, 1]``, ``k̃ = [k, log s / scale]``, ``ṽ = [v, 0]``
give ``scale · q̃·k̃ = scale · q·k + log s``; q, k and v are zero-padded to a head dim that is a
multiple of 8 (what the fused kernels accept), the softmax scale is passed explicitly (SDPA's
default would be that of the padded width) and the output is sliced back.

Masked Last-Layer Fusion (prune mode) hides the re-inserted (stale) tokens from the kept ones: as
a ``-inf`` mask it rules out the fast kernels too. Folded, the last block's attention runs as two
maskless calls on the tokens sorted kept-first: the kept queries against the kept keys, the stale
queries against every key (:func:`two_call_sdpa`).

``prop_attn="folded"`` selects both for the single-stage merges and for masked LLF of a timm
``VisionTransformer`` whose blocks are timm's standard ``Block`` and ``Attention`` (checked when
patching); the mask forms stay the default, and the two agree to rounding (tested).
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


class StaleKeys(NamedTuple):
    """Masked LLF to apply as two maskless calls: ``order [B, N]`` lists every image's kept tokens
    first (``num_kept`` of them, the same count for every image), then its stale ones."""

    order: torch.Tensor
    num_kept: int

    def as_mask(self) -> torch.Tensor:
        """The same rule as an additive mask ``[B, 1, N, N]``: ``-inf`` where a kept query meets a stale key."""
        rank = torch.argsort(self.order, dim=1)  # where each token stands in the kept-first order
        stale = rank >= self.num_kept
        hidden = ~stale[:, :, None] & stale[:, None, :]
        return torch.zeros(hidden.shape, device=hidden.device).masked_fill(hidden, float("-inf"))[:, None]


def two_call_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: StaleKeys, scale: float) -> torch.Tensor:
    """Masked-LLF attention as two maskless SDPA calls. ``q, k, v [B, H, N, d]``; returns ``[B, H, N, d]``
    in the tokens' own order."""
    b, h, n, d = q.shape
    where = keys.order[:, None, :, None].expand(b, h, n, d)
    q, k, v = (t.gather(2, where) for t in (q, k, v))
    m = keys.num_kept
    kept = F.scaled_dot_product_attention(q[:, :, :m], k[:, :, :m], v[:, :, :m], scale=scale)
    stale = F.scaled_dot_product_attention(q[:, :, m:], k, v, scale=scale)
    return torch.empty_like(q).scatter(2, where, torch.cat([kept, stale], dim=2))


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


def folded_attention(attn, x: torch.Tensor, bias: FoldedSizes | StaleKeys) -> torch.Tensor:
    """timm ``Attention.forward`` on ``x [B, K, C]`` (eval mode) with the bias folded in: the log sizes
    into the dot product, or masked LLF as two calls."""
    b, n, _ = x.shape
    gate = attn.gate(x).sigmoid() if getattr(attn, "gate", None) is not None else None
    q, k, v = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    if isinstance(bias, StaleKeys):
        out = two_call_sdpa(q, k, v, bias, float(attn.scale))
    else:
        out = folded_sdpa(q, k, v, bias.log_sizes, float(attn.scale))
    out = attn.norm(out.transpose(1, 2).reshape(b, n, -1))
    if gate is not None:
        out = out * gate
    return attn.proj_drop(attn.proj(out))


def folded_block(block, x: torch.Tensor, bias: FoldedSizes | StaleKeys) -> torch.Tensor:
    """A timm ``Block`` on ``x [B, K, D]`` with proportional attention or masked LLF folded into its attention."""
    x = x + block.drop_path1(block.ls1(folded_attention(block.attn, block.norm1(x), bias)))
    return x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))
