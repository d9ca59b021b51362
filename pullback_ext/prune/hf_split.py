"""The methods that reduce inside a layer on the Hugging Face layer loops of :mod:`pullback_ext.families`.

The per-block methods (ToMe and every method of :mod:`pullback_ext.prune.methods.merging`'s loop,
EViT) reduce between a layer's attention and its MLP: :func:`split` runs a layer of any family in
those two halves, from the family's :class:`~pullback_ext.families.adapter.AttentionLayout`
(norm, projections, head width, logit scale) and :class:`~pullback_ext.families.adapter.Branches`
(output projection, LayerScale, MLP), as the :class:`~pullback_ext.prune.split_block.SplitBlock`
that their loops take for timm blocks. The attention half runs
``scaled_dot_product_attention`` with the additive bias (ToMe's proportional attention) on every
family alike, DPT included; Expedite and ASAP run whole layers and read attention probabilities
between them, as every family gives them.

On a RoPE family (DINOv3) the attention half rotates the queries and keys of the current tokens by
the rotary rows of their original positions, which the token state
(:class:`~pullback_ext.prune.merged_tokens.MergedTokens`) tracks through ToMe's and PiToMe's
reordering (a merged token at its destination's position); EViT's fused token is not rotated (see
:mod:`pullback_ext.prune.rope`).

What each family takes follows from its :func:`traits` and each method's needs
(:func:`pullback_ext.prune.methods.supported`): a family without a class token (SigLIP) runs no
method that reads it; a RoPE family none that makes tokens without a rotary position.
"""

from __future__ import annotations

import operator
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from pullback_ext.errors import PullbackError
from pullback_ext.families import HFFamily
from pullback_ext.prune.methods import check_supported
from pullback_ext.prune.methods.base import Traits
from pullback_ext.prune.pipeline import run_blocks
from pullback_ext.prune.split_block import Attended, SplitBlock


def _apply(layer, paths: tuple, h: torch.Tensor) -> torch.Tensor:
    for path in paths:
        h = operator.attrgetter(path)(layer)(h)
    return h


def attend(layer, state, bias: Optional[torch.Tensor], family: HFFamily, rows: Optional[Callable] = None) -> Attended:
    """The attention half of a layer of ``family`` on ``x = state.x [B, K, D]``: ``x +
    branch(attention(norm(x)))`` with the additive ``bias`` (``[B, 1, 1|K, K]`` or None) on the
    logits of every head, and the queries and keys ``[B, H, K, d]`` it used (inference: no
    dropout); RoPE families rotate them by ``rows(state)``, the rotary rows of the current tokens."""
    if family.rotary and rows is None:
        raise PullbackError(f"rows: {family.title} layers run in halves need the rotary rows of the current tokens; got None")
    x = state.x
    attn, _, (q, k, v) = family.heads(layer, x, 3)
    if family.rotary:
        q, k = family.rotate(q, k, rows(state))
    scale = float(getattr(attn, family.attention.scaling))
    mask = None if bias is None else bias.to(q.dtype)
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return Attended(_attention_out(layer, x, context, family), q, k, scale)


def _attention_out(layer, x: torch.Tensor, context: torch.Tensor, family: HFFamily) -> torch.Tensor:
    """``x + branch(heads merged)`` ``[B, K, D]`` from the attention's ``context [B, H, K, d]``."""
    merged = context.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
    return x + _apply(layer, family.branches.attention_out, merged)


def attend_with(layer, x: torch.Tensor, probs: torch.Tensor, family: HFFamily) -> torch.Tensor:
    """The attention half of a layer of ``family`` on ``x [B, K, D]`` with the attention probabilities
    ``probs [B, H, K, K]`` in place of its own: ``x + branch(probs @ V(norm(x)))`` (no queries or
    keys, so no rotation on a RoPE family)."""
    layout = family.attention
    attn = family.attention_module(layer)
    h = getattr(layer, layout.norm)(x)
    b, k, _ = h.shape
    v = getattr(attn, layout.projections[2])(h).view(b, k, -1, getattr(attn, layout.head_size)).transpose(1, 2)
    return _attention_out(layer, x, probs.to(v.dtype) @ v, family)


def feed_forward(layer, x: torch.Tensor, family: HFFamily) -> torch.Tensor:
    """The MLP half of a layer of ``family``: ``x + branch(mlp(norm(x)))`` ``[B, K, D]``."""
    b = family.branches
    return x + _apply(layer, b.mlp, getattr(layer, b.mlp_norm)(x))


def split(family: HFFamily, rows: Optional[Callable] = None) -> SplitBlock:
    """The layers of ``family`` in two halves, for the originals that reduce between them
    (``rows(state)``: the rotary rows of the current tokens, RoPE families)."""
    return SplitBlock(attend=partial(attend, family=family, rows=rows), feed_forward=partial(feed_forward, family=family),
                      attend_with=partial(attend_with, family=family))


def run(family: HFFamily, reduction, x: torch.Tensor, layers, call_layer, attention_probs, rows: Optional[Callable] = None):
    """Run ``layers`` of ``family`` on ``x [B, N, D]`` with the original method of ``reduction``
    (``call_layer(layer, state, bias)``, ``attention_probs(layer, x, bias)``: see
    :func:`~pullback_ext.prune.pipeline.run_blocks`; ``rows``: see :func:`split`). Returns
    ``(final [B, N, D], [output of layer i, full-length [B, N, D], for every layer])``."""
    check_supported(reduction.method.name, Traits.of(family), family.title)
    final, taken = run_blocks(reduction, x, layers, call_layer, attention_probs, take=range(len(layers)),
                              split=split(family, rows))
    return final, [taken[i] for i in range(len(layers))]
