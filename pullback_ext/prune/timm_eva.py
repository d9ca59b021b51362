"""The block loop of a timm ``Eva`` (EVA-02, the RoPE ViTs, timm's DINOv3 ports) with token reduction.

An ``Eva`` differs from a ``VisionTransformer`` in two places the patched forward follows: its
``_pos_embed`` also returns the rotary table (``[n, d]``, or one ``[H, n, d]`` per block for the
"mixed" RoPE), and every block takes it (``block(x, rope=..., attn_mask=...)``), rotating all
tokens but the prefix. Each current token is given the row of its own original position
(:mod:`pullback_ext.prune.rope`). LayerScale (``gamma_1``, ``gamma_2``) runs inside the block.

The methods that reduce between attention and MLP (``needs.split_blocks``: ToMe, PiToMe, EViT,
…) run an ``EvaBlock`` in two halves (:func:`attend`, :func:`feed_forward`), the attention half
with the rotary rows of the current tokens' original positions (a merged token at its
destination's; EViT's fused token not rotated); ASAP runs whole blocks. Methods whose tokens have no rotary position (Expedite's clusters) or that add a prefix token
(TAP's register) are refused (:func:`pullback_ext.prune.timm_vit.traits`).
"""

from __future__ import annotations

from typing import Optional

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune.rope import DeferredAttention, RotaryRows, still_sin_cos_cat
from pullback_ext.prune.split_block import Attended, SplitBlock
from pullback_ext.prune.timm_blocks import BlockRunner, attention_given, attention_with_qk, splitting_methods


def _rotate(t: torch.Tensor, rope: torch.Tensor, attn) -> torch.Tensor:
    """What the attention does to queries or keys ``t [B, H, K, d]``: rotate all but its prefix tokens."""
    from timm.layers import apply_rot_embed_cat

    p = attn.num_prefix_tokens
    return torch.cat([t[:, :, :p], apply_rot_embed_cat(t[:, :, p:], rope, half=getattr(attn, "rotate_half", False))], dim=2)


def _attention_qk(attn, h: torch.Tensor, rope: Optional[torch.Tensor], bias: Optional[torch.Tensor]):
    """``attn(h, rope=rope, attn_mask=bias)`` and the queries and keys ``[B, H, K, d]`` its logits
    used: after ``q_norm`` / ``k_norm``, rotated, the keys repeated per query head (grouped-query
    attention)."""
    out, q, k = attention_with_qk(attn, h, rope=rope, attn_mask=bias)
    if rope is not None:
        q, k = _rotate(q, rope, attn), _rotate(k, rope, attn)
    return out, q, k.repeat_interleave(getattr(attn, "num_kv_groups", 1), dim=1)


def attention_probs(block, x: torch.Tensor, bias: Optional[torch.Tensor], rope: Optional[torch.Tensor]) -> torch.Tensor:
    """Head-averaged attention probabilities ``[B, K, K]`` of an Eva block on input ``x [B, K, D]``
    with rotary rows ``rope`` (``bias``: additive logit mask or None)."""
    attn = block.attn
    if not all(hasattr(attn, a) for a in ("q_norm", "k_norm", "scale", "num_prefix_tokens")):
        raise PullbackError(f"attention-based strategies need Eva attention with q_norm / k_norm; got {type(attn).__name__}")
    _, q, k = _attention_qk(attn, block.norm1(x), rope, bias)
    logits = (q * attn.scale) @ k.transpose(-2, -1)
    if bias is not None:
        logits = logits + bias
    return logits.softmax(dim=-1).mean(dim=1)


def _check_splittable(block) -> None:
    from timm.models.eva import EvaBlock

    attn = getattr(block, "attn", None)
    if not (isinstance(block, EvaBlock) and type(block).forward is EvaBlock.forward
            and all(hasattr(attn, a) for a in ("q_norm", "k_norm", "scale", "num_prefix_tokens"))):
        raise PullbackError(f"{splitting_methods()} run timm's pre-norm EvaBlock in two halves (attention, then MLP); "
                            f"got {type(block).__name__} with {type(attn).__name__}")


def attend(block, state, bias: Optional[torch.Tensor], rope: Optional[torch.Tensor]) -> Attended:
    """The attention half of an ``EvaBlock`` on ``x = state.x [B, K, D]`` with rotary rows ``rope``:
    ``x + drop_path1(gamma_1 · attn(norm1(x)))`` with the additive ``bias``, and the queries and
    keys ``[B, H, K, hd]`` its logits used (after ``q_norm`` / ``k_norm`` and the rotation)."""
    _check_splittable(block)
    attn, x = block.attn, state.x
    out, q, k = _attention_qk(attn, block.norm1(x), rope, bias)
    if block.gamma_1 is not None:
        out = block.gamma_1 * out
    return Attended(x + block.drop_path1(out), q, k, float(attn.scale))


def attend_with(block, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The attention half of an ``EvaBlock`` on ``x [B, K, D]`` with the attention probabilities
    ``probs [B, H, K, K]`` in place of its own (no queries or keys, so no rotation): ``x +
    drop_path1(gamma_1 · proj(probs @ V(norm1(x))))``."""
    _check_splittable(block)
    out = attention_given(block.attn, block.norm1(x), probs)
    if block.gamma_1 is not None:
        out = block.gamma_1 * out
    return x + block.drop_path1(out)


def feed_forward(block, x: torch.Tensor) -> torch.Tensor:
    """The MLP half of an ``EvaBlock``: ``x + drop_path2(gamma_2 · mlp(norm2(x)))``."""
    out = block.mlp(block.norm2(x))
    if block.gamma_2 is not None:
        out = block.gamma_2 * out
    return x + block.drop_path2(out)


def embed(model, x: torch.Tensor) -> tuple[torch.Tensor, BlockRunner]:
    """The input of the first block ``[B, N, D]`` of ``model`` on images ``x``, and how to run its
    blocks on reduced tokens (with the rotary rows of the current tokens)."""
    tokens, rope = model._pos_embed(model.patch_embed(x))
    tokens = model.norm_pre(tokens)
    rows = RotaryRows(int(model.num_prefix_tokens), still_sin_cos_cat)
    per_block = rope is not None and getattr(model, "rope_mixed", False)  # rope [depth, H, n, d]
    index = {id(block): i for i, block in enumerate(model.blocks)}
    deferred = DeferredAttention(attention_probs)

    def block_rope(block, state) -> Optional[torch.Tensor]:
        if rope is None:
            return None
        key = index[id(block)] if per_block else 0
        return rows.select(state, (rope[key] if per_block else rope,), key)[0]

    def call_block(block, state, bias: Optional[torch.Tensor]) -> torch.Tensor:
        block_rows = block_rope(block, state)
        deferred.fill(block, state.x, bias, block_rows)
        return block(state.x, rope=block_rows, attn_mask=bias)

    split = SplitBlock(attend=lambda block, state, bias: attend(block, state, bias, block_rope(block, state)),
                       feed_forward=feed_forward, attend_with=attend_with)
    return tokens, BlockRunner(call_block, deferred.request, split)
