"""The token encoder shared by the SPN and the importance head (docs/formulas.md §3).

``LayerNorm → Linear(D→H)`` plus a per-token log-RMS channel, then two pre-norm multi-head
self-attention blocks (optionally each with a small per-token MLP). The probe Jacobian depends on
each token's scale (a LayerNorm downstream divides by it), which the input LayerNorm would
otherwise hide, hence the extra channel.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from pullback_ext.errors import PullbackError


class AttentionBlock(nn.Module):
    """Pre-norm multi-head self-attention with a residual, x + Attn(LN(x)), x[B,N,H]; with
    ``mlp_hidden > 0`` followed by a pre-norm per-token MLP, x + MLP(LN(x)).

    The attention works in ``attn_dim`` channels (heads × head size), which keeps the block
    small next to the input projection.
    """

    def __init__(self, hidden: int, heads: int, attn_dim: int, mlp_hidden: int = 0) -> None:
        super().__init__()
        if attn_dim % heads != 0:
            raise PullbackError(f"attn_dim: expected a multiple of heads={heads}, got {attn_dim}")
        self.heads = heads
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * attn_dim, bias=False)
        self.proj = nn.Linear(attn_dim, hidden)
        self.mlp = (nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, mlp_hidden), nn.GELU(), nn.Linear(mlp_hidden, hidden))
                    if mlp_hidden else None)

    def forward(self, x: Tensor) -> Tensor:
        B, N, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(out.transpose(1, 2).reshape(B, N, -1))
        return x if self.mlp is None else x + self.mlp(x)


class TokenEncoder(nn.Module):
    """F[B,N,D] -> hidden token states h[B,N,H]."""

    def __init__(self, dim: int, hidden: int = 256, heads: int = 4, depth: int = 2, mlp_hidden: int = 0) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("hidden", hidden), ("heads", heads), ("depth", depth)):
            if not isinstance(value, int) or value < 1:
                raise PullbackError(f"{name}: expected a positive int, got {value!r}")
        if not isinstance(mlp_hidden, int) or mlp_hidden < 0:
            raise PullbackError(f"mlp_hidden: expected an int >= 0, got {mlp_hidden!r}")
        if hidden % 4 != 0:
            raise PullbackError(f"hidden: expected a multiple of 4, got {hidden}")
        attn_dim = hidden // 4
        if attn_dim % heads != 0:
            raise PullbackError(f"heads: expected a divisor of hidden/4={attn_dim}, got {heads}")
        self.dim = dim
        self.input_norm = nn.LayerNorm(dim)
        self.embed = nn.Linear(dim, hidden)
        self.scale_embed = nn.Linear(1, hidden, bias=False)
        self.blocks = nn.ModuleList(AttentionBlock(hidden, heads, attn_dim, mlp_hidden) for _ in range(depth))

    def check_input(self, F: Tensor) -> None:
        if not isinstance(F, Tensor):
            raise TypeError(f"F: expected a torch.Tensor [B,N,D], got {type(F).__name__}")
        if not F.is_floating_point():
            raise TypeError(f"F: expected a floating-point tensor, got dtype {F.dtype}")
        if F.dim() != 3 or F.shape[-1] != self.dim or F.shape[1] < 1:
            raise PullbackError(f"F: expected shape [B,N,{self.dim}], got {tuple(F.shape)}")

    def forward(self, F: Tensor) -> Tensor:
        self.check_input(F)
        log_rms = 0.5 * torch.log(F.pow(2).mean(-1, keepdim=True) + 1e-12)
        h = self.embed(self.input_norm(F)) + self.scale_embed(log_rms)
        for block in self.blocks:
            h = block(h)
        return h
