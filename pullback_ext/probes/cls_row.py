"""The last transformer block evaluated for the CLS row only.

When a probe's output is the CLS token, the last block's output matters only in row 0: the keys
and values still need every token, but the query, the attention output, the projection and the MLP
are needed for one token instead of N. The result is the full block's row 0 (the same operations on
the same rows, equal up to rounding), and JVPs / VJPs through it cost a fraction of the full block's.
Only blocks whose structure is known are taken this way (timm's ``Block`` with its ``Attention``);
any other block runs in full.
"""

from __future__ import annotations

import torch
import torch.nn.functional as nnf
from torch import Tensor


def supports_cls_row(block: torch.nn.Module) -> bool:
    """True when ``block`` is exactly timm's pre-norm ``Block`` with the standard ``Attention``."""
    try:
        from timm.layers.attention import Attention
        from timm.models.vision_transformer import Block
    except ImportError:  # pragma: no cover - timm is a dependency of the timm probes
        return False
    return type(block) is Block and type(block.attn) is Attention


def run_blocks_for_cls_row(blocks, x: Tensor) -> Tensor | None:
    """x[B,N,D] through ``blocks`` (a sequence), the last one for the CLS row only: [B,1,D].
    None when there is no block or the last one is not of a known structure (run them in full)."""
    blocks = list(blocks)
    if not blocks or not supports_cls_row(blocks[-1]):
        return None
    for block in blocks[:-1]:
        x = block(x)
    return cls_row_block(blocks[-1], x)


def cls_row_block(block: torch.nn.Module, x: Tensor) -> Tensor:
    """x[B,N,D] -> row 0 of ``block(x)``: [B,1,D]. The block must satisfy ``supports_cls_row`` and be
    in eval mode (dropout and drop-path off; the probe's ``jvp_friendly`` guarantees that)."""
    attn = block.attn
    h = block.norm1(x)
    heads, hd = attn.num_heads, attn.head_dim
    A = getattr(attn, "attn_dim", heads * hd)  # older timm: no attn_dim / norm / gate
    weight, bias = attn.qkv.weight, attn.qkv.bias
    B, N, _ = h.shape
    q = nnf.linear(h[:, :1], weight[:A], None if bias is None else bias[:A])
    kv = nnf.linear(h, weight[A:], None if bias is None else bias[A:])
    q = attn.q_norm(q.reshape(B, 1, heads, hd).transpose(1, 2))
    k, v = kv.reshape(B, N, 2, heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
    k = attn.k_norm(k)
    weights = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
    o = (weights @ v).transpose(1, 2).reshape(B, 1, A)
    norm, gate = getattr(attn, "norm", None), getattr(attn, "gate", None)
    if norm is not None:
        o = norm(o)
    if gate is not None:
        o = o * gate(h[:, :1]).sigmoid()
    o = attn.proj(o)
    row = x[:, :1] + block.ls1(o)
    return row + block.ls2(block.mlp(block.norm2(row)))
