"""EViT as its authors run it (Liang et al., "Not All Patches are What You Need: Expediting Vision
Transformers via Token Reorganizations", ICLR 2022).

In the blocks of ``evit_layers`` (default: EViT's 4th, 7th and 10th of 12 blocks, i.e. 0-based
3, 6, 9, scaled to the model's depth by :func:`~pullback_ext.prune.schedules.scale_layers`),
between attention and MLP:

1. the attentiveness of a token is the attention the class token pays it in *this* block's
   attention, averaged over heads;
2. the ``ceil(keep_rate · n)`` most attentive of the ``n`` current patch tokens are kept (in their
   order); registers are kept like CLS;
3. the inattentive ones are fused into one extra token ``x_fused = Σ_i a_i x_i``, their features
   weighted by their attentiveness ``a_i`` — EViT's fusion, a weighted sum whose weights are the
   softmax probabilities themselves (not renormalised to 1) — appended after the patch tokens.

The fused token is not a patch token: later stages neither rank nor keep it, they fuse it again
with their newly inattentive tokens, weighted by the attention it receives in that block (its
features enter the new sum like those of any inattentive token), so there is at most one fused
token. On a RoPE backbone the kept tokens keep their own rotary positions and the fused token, a
sum over many positions, is not rotated (as the prefix tokens are not). (EViT's code ranks the fused token with the patch tokens instead, so that it may also be
kept as an ordinary token.) A stage that keeps every patch token leaves the fused token as it is.
η counts the fused token as removed. Full-length features give every fused-away token the fused
token's features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from pullback_ext import ops
from pullback_ext.errors import PullbackError
from pullback_ext.prune.merged_tokens import MergedTokens, run_tracked
from pullback_ext.prune.methods.base import BackboneShape, BlockLoop, BlockLoopMethod, Needs
from pullback_ext.prune.option_checks import check_layer_range, is_real, layer_list
from pullback_ext.prune.schedules import scale_layers
from pullback_ext.prune.split_block import Attended

REFERENCE_LAYERS = (3, 6, 9)  # 0-based: EViT's 4th, 7th and 10th blocks of a 12-block ViT


def default_layers(depth: int) -> tuple:
    """EViT's reorganisation blocks for a ``depth``-block model."""
    return scale_layers(REFERENCE_LAYERS, depth)


def kept_count(keep_rate: float, num_patch: int) -> int:
    """Patch tokens a stage keeps: ``ceil(keep_rate · num_patch)``, as EViT computes it."""
    return math.ceil(keep_rate * num_patch)


def cls_attention(attended: Attended) -> torch.Tensor:
    """The class token's attention ``[B, K]`` in the block, averaged over heads (the block runs
    without an attention bias under EViT)."""
    logits = (attended.q[:, :, :1] * attended.scale) @ attended.k.transpose(-2, -1)  # [B, H, 1, K]
    return logits.softmax(dim=-1).mean(dim=1)[:, 0]


def fused_token(x: torch.Tensor, attentiveness: torch.Tensor, inattentive: torch.Tensor) -> torch.Tensor:
    """EViT's fused token ``[B, 1, D]``: ``Σ_i a_i x_i`` over the ``inattentive [B, K]`` (bool) tokens
    of ``x [B, K, D]``, ``a = attentiveness [B, K]``."""
    weights = attentiveness.to(x.dtype).masked_fill(~inattentive, 0)
    return torch.einsum("bk,bkd->bd", weights, x)[:, None]


def fuse_inattentive(state: MergedTokens, attentiveness: torch.Tensor, keep: int) -> MergedTokens:
    """Keep the ``keep`` most attentive patch tokens of ``state.x [B, K, D]`` (``attentiveness
    [B, K]``), fuse the other patch tokens and any fused token into one; returns
    ``[prefix, kept, fused]`` of ``num_prefix + keep + 1`` tokens."""
    p, n = state.num_prefix, state.num_patch
    b, k, _ = state.x.shape
    top = torch.topk(attentiveness[:, p:p + n], keep, dim=1, sorted=False).indices.sort(dim=1).values + p
    inattentive = torch.ones(b, k, dtype=torch.bool, device=state.x.device).scatter(1, top, False)
    inattentive[:, :p] = False
    fused = fused_token(state.x, attentiveness, inattentive)
    kept = ops.gather_tokens(state.x, top, check_values=False)  # top comes from topk: valid by construction
    new_index = torch.full((b, k), p + keep, dtype=torch.long, device=state.x.device)  # the fused token
    new_index[:, :p] = torch.arange(p, device=state.x.device)
    new_index.scatter_(1, top, torch.arange(p, p + keep, device=state.x.device).expand(b, keep))
    places = torch.cat([torch.arange(p, device=state.x.device).expand(b, p), top], dim=1)
    return state.regroup(torch.cat([state.x[:, :p], kept, fused], dim=1), new_index, places, num_extra=1)


def run(reduction, x: torch.Tensor, blocks, call_block, split, take=()):
    """Run ``blocks`` on ``x [B, N, D]`` reorganising tokens as EViT does (``reduction``: resolved
    options with ``strategy="evit"``; ``split``: a :class:`~pullback_ext.prune.split_block.SplitBlock`).
    Returns ``(final [B, N, D], {i: features after block i [B, N, D] for i in take})``."""
    o = reduction.options

    def step(i: int, block, state: MergedTokens) -> MergedTokens:
        keep = kept_count(o.keep_rate, state.num_patch)
        if i not in o.evit_layers or keep >= state.num_patch:
            return state.with_x(call_block(block, state, None))
        attended = split.attend(block, state, None)
        state = fuse_inattentive(state.with_x(attended.x), cls_attention(attended), keep)
        return state.with_x(split.feed_forward(block, state.x))

    return run_tracked(MergedTokens(x=x, num_prefix=reduction.backbone.num_prefix), blocks, step, take)


def patch_tokens_per_block(options, num_patch: int, depth: int) -> list[int]:
    """Patch tokens after each block (the fused token not counted) when EViT runs with ``options``."""
    counts = []
    for i in range(depth):
        if i in options.evit_layers:
            num_patch = min(num_patch, kept_count(options.keep_rate, num_patch))
        counts.append(num_patch)
    return counts


@dataclass(frozen=True)
class EViTOptions:
    """``keep_rate``: fraction of patch tokens each stage keeps, in (0, 1] (required);
    ``evit_layers``: the blocks that reorganise (0-based; None: EViT's 4th/7th/10th of 12, scaled)."""

    keep_rate: Optional[float] = None
    evit_layers: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        if self.keep_rate is not None and (not is_real(self.keep_rate) or not 0.0 < float(self.keep_rate) <= 1.0):
            raise PullbackError(f"keep_rate must be None or a float in (0, 1]; got {self.keep_rate!r}")
        object.__setattr__(self, "keep_rate", None if self.keep_rate is None else float(self.keep_rate))
        if self.evit_layers is not None:
            object.__setattr__(self, "evit_layers", layer_list(self.evit_layers, "evit_layers"))


class EViT(BlockLoopMethod):
    name, short, title = "evit", "EViT", "EViT (inattentive tokens fused at 3 blocks)"
    options_type = EViTOptions
    needs = Needs(class_token="EViT ranks the tokens by the class token's attention",
                  split_blocks="EViT reorganises the tokens between attention and MLP")
    required = ("keep_rate", "fraction of patch tokens kept")
    rules = ("top CLS attention at three blocks (authors' selection rule; run frozen here, its authors fine-tune with it)",
             "inattentive tokens fused into one, attention-weighted")
    sweep = {"keep_rate": (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)}

    def resolve(self, options, backbone: BackboneShape) -> dict:
        layers = options.evit_layers
        if layers is None:
            try:
                layers = default_layers(backbone.depth)
            except PullbackError as exc:
                raise PullbackError(f"evit_layers: EViT's blocks 3, 6, 9 of 12 do not scale to this {backbone.depth}-block model "
                                    f"({exc}); give evit_layers=") from None
        check_layer_range(layers, backbone.depth, False, "evit_layers")
        return dict(super().resolve(options, backbone), evit_layers=layers)

    def run(self, reduction, x: torch.Tensor, loop: BlockLoop, take=()):
        return run(reduction, x, loop.blocks, loop.call_block, loop.split, take)

    def patch_tokens_per_block(self, reduction, num_patch: int) -> list:
        return patch_tokens_per_block(reduction.options, num_patch, reduction.backbone.depth)


ORDER = 2
METHODS = (EViT(),)
