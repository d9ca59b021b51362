"""Reduction-aware ``forward_features`` / ``forward_intermediates`` for timm VisionTransformer.

They follow timm's own forward (patch embedding, position embedding, blocks, final norm) and only
swap the plain block loop for :func:`pullback_ext.prune.pipeline.run_blocks`; with nothing to
remove they perform exactly the same operations, so the output is bit-identical. The methods that
reduce between attention and MLP (``needs.split_blocks``: ToMe, EViT, …) run a timm ``Block`` in
its two halves (:data:`SPLIT`), with LayerScale (``ls1``, ``ls2``) and drop path applied as the
block applies them. A timm ``Eva`` (EVA-02, RoPE ViTs) embeds and runs its
blocks with rotary positions: :mod:`pullback_ext.prune.timm_eva` gives its :class:`BlockRunner`
(and the halves of its blocks).
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.families.timm_eva import ADAPTER as EVA
from pullback_ext.families.timm_vit import ADAPTER as VIT
from pullback_ext.prune import timm_eva
from pullback_ext.prune.folded_attention import FoldedSizes, StaleKeys, folded_block
from pullback_ext.prune.methods import check_supported
from pullback_ext.prune.methods.base import BackboneShape, Reduction, Traits
from pullback_ext.prune.pipeline import run_blocks
from pullback_ext.prune.split_block import Attended, SplitBlock
from pullback_ext.prune.timm_blocks import BlockRunner, attention_given, attention_with_qk, splitting_methods

REQUIRED = ("patch_embed", "_pos_embed", "blocks", "norm", "num_prefix_tokens", "forward_features")


def check_model(model) -> None:
    """Raise unless ``model`` is a timm ``VisionTransformer`` or ``Eva`` (has what the patched forward uses)."""
    missing = [a for a in REQUIRED if not hasattr(model, a)]
    if missing:
        raise PullbackError(f"model must be a timm VisionTransformer; {type(model).__name__} lacks {', '.join(missing)}")


def traits(model) -> Traits:
    """What a timm ``VisionTransformer`` or ``Eva`` offers the methods: its family adapter's traits
    (an ``Eva`` has rotary positions and no room for an extra prefix token in its rotary rows)."""
    return Traits.of(EVA if EVA.matches(model) else VIT, model)


def check_strategy(model, strategy: str) -> None:
    """Raise if ``model`` cannot run ``strategy`` (:func:`traits`)."""
    check_supported(strategy, traits(model), f"a timm {type(model).__name__}")


def backbone_shape(model) -> BackboneShape:
    """Depth, prefix tokens, class token and patch tokens (at its configured image size) of a timm ``VisionTransformer``."""
    patches = getattr(getattr(model, "patch_embed", None), "num_patches", None)
    return BackboneShape(depth=len(model.blocks), num_prefix=int(model.num_prefix_tokens),
                         has_cls=getattr(model, "cls_token", None) is not None, num_patch=None if patches is None else int(patches))


def attention_probs(block, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Head-averaged attention probabilities ``[B, K, K]`` of a timm ``Block`` on input ``x``."""
    attn = getattr(block, "attn", None)
    if attn is None or not all(hasattr(attn, a) for a in ("qkv", "num_heads", "head_dim", "scale")):
        raise PullbackError(f"attention-based strategies need timm Attention blocks with a fused qkv; got {type(attn).__name__}")
    if isinstance(bias, (FoldedSizes, StaleKeys)):
        bias = bias.as_mask()
    h = block.norm1(x)
    b, k, _ = h.shape
    qkv = attn.qkv(h).reshape(b, k, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, key = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
    logits = (q * attn.scale) @ key.transpose(-2, -1)
    if bias is not None:
        logits = logits + bias
    return logits.softmax(dim=-1).mean(dim=1)


def call_block(block, state, bias) -> torch.Tensor:
    """Run a timm ``Block`` on the current tokens (with the proportional-attention bias: a mask, or
    :class:`FoldedSizes` to fold into the attention)."""
    if isinstance(bias, (FoldedSizes, StaleKeys)):
        return folded_block(block, state.x, bias)
    return block(state.x) if bias is None else block(state.x, attn_mask=bias)


def _check_splittable(block) -> None:
    from timm.models.vision_transformer import Block

    attn = getattr(block, "attn", None)
    if not (isinstance(block, Block) and type(block).forward is Block.forward
            and all(hasattr(attn, a) for a in ("q_norm", "k_norm", "scale"))):
        raise PullbackError(f"{splitting_methods()} run timm's standard Block in two halves (attention, then MLP); "
                            f"got {type(block).__name__} with {type(attn).__name__}")


def attend(block, state, bias: Optional[torch.Tensor]) -> Attended:
    """The attention half of a timm ``Block`` on ``x = state.x [B, K, D]``: ``x +
    drop_path1(ls1(attn(norm1(x))))`` with the additive ``bias``, and the queries and keys ``[B, H,
    K, hd]`` the attention used, caught at its ``q_norm`` / ``k_norm`` so that the block's own
    attention code runs unchanged."""
    _check_splittable(block)
    x = state.x
    out, q, k = attention_with_qk(block.attn, block.norm1(x), attn_mask=bias)
    return Attended(x + block.drop_path1(block.ls1(out)), q, k, float(block.attn.scale))


def feed_forward(block, x: torch.Tensor) -> torch.Tensor:
    """The MLP half of a timm ``Block``: ``x + drop_path2(ls2(mlp(norm2(x))))``."""
    return x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))


def attend_with(block, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The attention half of a timm ``Block`` on ``x [B, K, D]`` with the attention probabilities
    ``probs [B, H, K, K]`` in place of its own: ``x + drop_path1(ls1(proj(probs @ V(norm1(x)))))``."""
    _check_splittable(block)
    return x + block.drop_path1(block.ls1(attention_given(block.attn, block.norm1(x), probs)))


SPLIT = SplitBlock(attend=attend, feed_forward=feed_forward, attend_with=attend_with)


def _embed(model, x: torch.Tensor) -> tuple[torch.Tensor, BlockRunner]:
    """The input of the first block ``[B, N, D]`` and the runner of the blocks."""
    if EVA.matches(model):
        return timm_eva.embed(model, x)
    x = model.patch_embed(x)
    x = model._pos_embed(x)
    x = model.patch_drop(x)
    return model.norm_pre(x), BlockRunner(call_block, attention_probs, SPLIT)


def _no_masks(attn_mask, is_causal) -> None:
    if attn_mask is not None or is_causal:
        raise PullbackError("a token-reduced model does not take attn_mask or is_causal; unpatch it first")


def forward_features(model, reduction: Reduction, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
    """timm ``forward_features`` (``VisionTransformer`` or ``Eva``) with token reduction; returns ``[B, N, D]``."""
    _no_masks(attn_mask, is_causal)
    tokens, runner = _embed(model, x)
    out, _ = run_blocks(reduction, tokens, model.blocks, runner.call_block, runner.attention_probs, split=runner.split)
    return model.norm(out)


def forward_intermediates(
    model,
    reduction: Reduction,
    x: torch.Tensor,
    indices: Optional[Union[int, List[int]]] = None,
    return_prefix_tokens: bool = False,
    norm: bool = False,
    stop_early: bool = False,
    output_fmt: str = "NCHW",
    intermediates_only: bool = False,
    output_dict: bool = False,
    attn_mask=None,
    is_causal: bool = False,
):
    """timm ``forward_intermediates`` with token reduction; intermediates are full-length."""
    from timm.models._features import feature_take_indices

    _no_masks(attn_mask, is_causal)
    if output_fmt not in ("NCHW", "NLC"):
        raise PullbackError(f"output_fmt must be NCHW or NLC; got {output_fmt!r}")
    take_indices, max_index = feature_take_indices(len(model.blocks), indices)
    b, _, height, width = x.shape
    blocks = model.blocks[: max_index + 1] if stop_early else model.blocks
    tokens, runner = _embed(model, x)
    final, taken = run_blocks(reduction, tokens, blocks, runner.call_block, runner.attention_probs, take=set(take_indices),
                              split=runner.split)
    intermediates = [model.norm(taken[i]) if norm else taken[i] for i in take_indices]
    p = model.num_prefix_tokens
    prefix_tokens = [y[:, :p] for y in intermediates] if p else None
    if p:
        intermediates = [y[:, p:] for y in intermediates]
    if output_fmt == "NCHW":
        h, w = model.patch_embed.dynamic_feat_size((height, width))
        intermediates = [y.reshape(b, h, w, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
    if output_dict:
        result = {"image_intermediates": intermediates}
        if prefix_tokens is not None and return_prefix_tokens:
            result["image_intermediates_prefix"] = prefix_tokens
        if not intermediates_only:
            result["image_features"] = model.norm(final)
        return result
    if return_prefix_tokens and prefix_tokens is not None:
        intermediates = list(zip(intermediates, prefix_tokens))
    if intermediates_only:
        return intermediates
    return model.norm(final), intermediates
