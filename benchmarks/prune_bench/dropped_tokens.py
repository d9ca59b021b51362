"""The speed a merge at ToMe's token counts could reach at most: the same counts with no merging.

``dropped_tokens(model, r)`` is a copy of a timm ViT whose every block, between attention and MLP,
keeps the first ``K - n`` of its ``K`` tokens, ``n`` what ToMe's step with ``r`` merges there
(``reference.merge_step_count``: ``r`` clipped to the bipartite split of the patch tokens; the
prefix tokens, class token and registers, come first and stay). The attention, the MLP and every
later block then run on exactly ToMe's token counts, and nothing ranks, matches or averages: one
slice per block. Its outputs are meaningless; its time and FLOPs are those of the token counts
alone, so a method's speed-up ÷ FLOP ratio over this row's says how much of the shortfall is the
merging's own cost and how much the smaller matrix products'.
"""

from __future__ import annotations

import copy
import types

import torch
from torch import nn

from pullback_ext import reference


def kept_tokens(tokens: int, r: int, num_prefix: int) -> int:
    """Tokens left after ToMe's step with ``r`` on ``tokens`` tokens, ``num_prefix`` of them prefix tokens."""
    return tokens - reference.merge_step_count("tome", r, num_prefix, tokens)


def _forward(block: nn.Module, r: int, num_prefix: int):
    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
        x = x[:, :kept_tokens(x.shape[1], r, num_prefix)]
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    return types.MethodType(forward, block)


def dropped_tokens(model: nn.Module, r: int) -> nn.Module:
    """A copy of the timm ViT ``model`` with ToMe ``r``'s token counts and no merging (see the module)."""
    model = copy.deepcopy(model)
    for block in model.blocks:
        block.forward = _forward(block, r, model.num_prefix_tokens)
    return model
