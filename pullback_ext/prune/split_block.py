"""How a backbone adapter runs one transformer block in two halves, for the methods that reduce
tokens between a block's attention and its MLP (``needs.split_blocks``: ToMe, EViT, …)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch


class Attended(NamedTuple):
    """The attention half of a block: ``x [B, K, D]`` = input + (layer-scaled) attention output;
    ``q, k [B, H, K, hd]`` the queries and keys the attention used (after any q/k norm and, on RoPE
    backbones, rotated: so ToMe's and PiToMe's key similarity there includes the tokens' relative
    positions); ``scale`` the factor of the logits, so that ``softmax(scale · q kᵀ + bias)`` are
    its probabilities."""

    x: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    scale: float


@dataclass(frozen=True)
class SplitBlock:
    """``attend(block, state, bias) -> Attended`` on the current tokens ``state.x [B, K, D]`` of a
    :class:`~pullback_ext.prune.merged_tokens.MergedTokens` (whose positions give a RoPE block its
    rotary rows; ``bias``: additive attention mask or None) and ``feed_forward(block, x [B, K, D])
    -> [B, K, D]`` (input + layer-scaled MLP output); the two in turn compute exactly what the
    block computes. ``attend_with(block, x [B, K, D], probs [B, H, K, K]) -> [B, K, D]``: the
    attention half with the given probabilities in place of its own, ``x + branch(proj(probs @
    V(norm(x))))`` (no queries or keys, hence no rotary rows); None where the adapter has none."""

    attend: Callable
    feed_forward: Callable
    attend_with: Optional[Callable] = None
