"""MCTF as its authors run it (Lee, Choi, Kim, "Multi-criteria Token Fusion with One-step-ahead
Attention for Efficient Vision Transformers", CVPR 2024), from their code, mlvlab/MCTF@2004da0
(``utils/mctf.py``, ``models/modules/blocks.py``, ``models/SA/MHSA.py``; lines cited below).

In every block of ``block_range`` (default: blocks 1 .. L−1, the authors' ``--activate_layer
[1, ..., 11]`` of 12, ``run/eval_deit_s_mctf.sh:13``) ``r`` tokens are fused *inside* the block,
between its attention probabilities and its attention output (``one_step_ahead=1``,
``blocks.py:37-41``):

1. the block's attention on its input, ``A = softmax(scale · q kᵀ + log s) [B, H, K, K]``
   (``MHSA.py:21-37``; ``log s`` with ``prop_attn`` from the first merge on);
2. the tokens of the block *input* split by position as ToMe's (A even, B odd; prefix tokens in
   neither), scored by the product of three criteria (``mctf.py:69-96``): similarity
   ``((cos + 1) / 2)^(1/τ_sim)`` of the inputs themselves, informativeness
   ``(ι_i ι_j)^(1/τ_info)`` with ``ι`` the inverse of the attention a token receives (mean over
   heads and queries, normalised by its maximum) and size ``(σ_i σ_j)^(1/τ_size)`` with ``σ`` the
   inverse size, normalised likewise (no size term before the first merge); τ = 0 leaves a criterion out;
3. bidirectional matching (``mctf.py:62-65, 101-120``): the ``⌊r/2⌋`` A tokens with the best score
   merge into their best B token; then, on the same scores, the ``⌈r/2⌉`` B tokens (those that
   just received merges included) with the best score to the unmerged A tokens merge into theirs;
   the tokens continue as ``[prefix, unmerged A (by position), unmerged B (by descending score)]``
   (``mctf.py:149``; without a prefix token the unmerged A stay in descending score order, ``:108-110``);
4. fused features are averages weighted by ``w = ā · s`` (the attention received times the size,
   ``mctf.py:185-199``) and sizes add up;
5. one-step-ahead attention (``mctf.py:191-194``): the fused tokens' attention is ``A`` itself
   with the key columns of each group added and its query rows averaged with the weights ``w``; the
   attention half of the block runs with it on the values of the fused tokens (``MHSA.py:38-48``),
   their own queries and keys never used; then the MLP half.

Per block ``r`` is clipped as the authors clip it (``mctf.py:25-26``): at least 10 tokens remain
(prefix included), and at most half the current patch tokens merge. The other blocks run
unchanged, with proportional attention from the first merge on. Their defaults
(``run/eval_deit_{t,s}_mctf.sh:10-13``, ``models/deit.py:74-89``): ``r = 16``, τ_sim = 1,
τ_info = 20, τ_size = 40, proportional attention on. Their published rows are fine-tuned with
MCTF (30 epochs, README.md:27); here it runs on frozen backbones.

Where their code does not carry over: registers (it protects the first rows of its set A, which are
the prefix tokens only when there is one; here no prefix token is in either set); ties go by
position (their sorts are not stable); MCTF-Fast's fractional ``r`` and their other variants
(``one_step_ahead`` 0 or 2, other poolings, one direction) are not offered. The attention half with
the fused attention applies it to the fused tokens' values (the block adapter's ``attend_with``);
the attention half on the block's input also computes the values and output of the tokens about to
be fused, which the authors' block skips (DeiT-S, r = 16: 6.22 GFLOPs counted here, 4.59 for
ToMe, 9.20 unreduced).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune.matching import working_precision
from pullback_ext.prune.merged_tokens import MergedTokens, run_tracked
from pullback_ext.prune.methods.base import BackboneShape, BlockLoop, Needs
from pullback_ext.prune.methods.merging import (Matching, MergeStep, MergingMethod, ToMeOptions, alternating_order,
                                                apply_matching, merge_values, positions_after_merge)
from pullback_ext.prune.option_checks import is_real
from pullback_ext.prune.split_block import Attended, SplitBlock

FLOOR = 10  # tokens (prefix included) a merge always leaves, utils/mctf.py:25
CRITERIA = {"tau_sim": "similarity", "tau_info": "informativeness", "tau_size": "size"}


def merge_count(r: int, num_prefix: int, num_patch: int) -> int:
    """Tokens one block merges when asked for ``r``: at least ``FLOOR`` tokens remain, at most half
    the ``num_patch`` current patch tokens merge (``utils/mctf.py:25-26``).
    >>> merge_count(16, 1, 196), merge_count(16, 1, 20), merge_count(16, 1, 8)
    (16, 10, 0)
    """
    k = num_prefix + num_patch
    if k - r < FLOOR:
        r = k - FLOOR
    return max(0, min(r, num_patch // 2))


def attention_probabilities(attended: Attended, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``softmax(scale · q kᵀ + bias) [B, H, K, K]`` of the block (working precision)."""
    logits = (working_precision(attended.q) * attended.scale) @ working_precision(attended.k).transpose(-2, -1)
    return (logits if bias is None else logits + bias.to(logits.dtype)).softmax(dim=-1)


def _inverse_ratio(values: torch.Tensor) -> torch.Tensor:
    """``(1 / v) / max(1 / v)`` over the tokens ``[B, K]``."""
    inverse = 1.0 / values
    return inverse / inverse.amax(dim=1, keepdim=True)


def _pair_product(per_token: torch.Tensor, order: torch.Tensor, a_start: int, size_a: int, tau: float) -> torch.Tensor:
    """``(v_i v_j)^(1/τ) [B, |A|, |B|]`` of a per-token ``[B, K]`` quantity over the A × B pairs."""
    ordered = torch.gather(per_token, 1, order)
    set_a, set_b = ordered[:, a_start:a_start + size_a], ordered[:, a_start + size_a:]
    return (set_a[:, :, None] * set_b[:, None, :]) ** (1.0 / tau)


def criteria_scores(x: torch.Tensor, probs: torch.Tensor, sizes: Optional[torch.Tensor], order: torch.Tensor,
                    a_start: int, size_a: int, options) -> torch.Tensor:
    """MCTF's score ``[B, |A|, |B|]`` of every A × B pair of the tokens ``x [B, K, D]`` (the block's
    input): similarity × informativeness (from ``probs [B, H, K, K]``) × size (``sizes [B, K]``,
    None before the first merge) (``utils/mctf.py:69-96``)."""
    unit = torch.nn.functional.normalize(working_precision(x), dim=-1)
    ordered = torch.gather(unit, 1, order[..., None].expand(-1, -1, unit.shape[-1]))
    cos = ordered[:, a_start:a_start + size_a] @ ordered[:, a_start + size_a:].transpose(1, 2)
    score = ((cos + 1) / 2) ** (1.0 / options.tau_sim) if options.tau_sim else torch.ones_like(cos)
    if options.tau_info > 0:
        score = score * _pair_product(_inverse_ratio(probs.mean(dim=(1, 2))), order, a_start, size_a, options.tau_info)
    if options.tau_size and sizes is not None:
        score = score * _pair_product(_inverse_ratio(working_precision(sizes)), order, a_start, size_a, options.tau_size)
    return score


def bidirectional_matching(score: torch.Tensor, order: torch.Tensor, num_prefix: int, count: int) -> Matching:
    """MCTF's two merging steps on ``score [B, |A|, |B|]`` of the split ``order [B, K]`` = ``[prefix,
    A, B]`` (``utils/mctf.py:101-120``) as one :class:`Matching` (an A token merged into a B token
    that moves on goes where that B token goes): the order is ``[prefix, unmerged A, merged A,
    B by descending step-2 score]``, the first ``⌈count/2⌉`` of the B merged."""
    p, (b, size_a, size_b) = num_prefix, score.shape
    r1, r2 = count // 2, count - count // 2
    best1, match1 = score.max(dim=-1)  # into B
    ranked_a = torch.argsort(best1, dim=1, descending=True, stable=True)
    src1, unmerged = ranked_a[:, :r1], ranked_a[:, r1:]
    if p:
        unmerged = unmerged.sort(dim=1).values
    best2, match2 = torch.gather(score, 1, unmerged[..., None].expand(-1, -1, size_b)).max(dim=1)  # into unmerged
    ranked_b = torch.argsort(best2, dim=1, descending=True, stable=True)
    set_a, set_b = order[:, p:p + size_a], order[:, p + size_a:]
    new_order = torch.cat([order[:, :p], torch.gather(set_a, 1, unmerged), torch.gather(set_a, 1, src1),
                           torch.gather(set_b, 1, ranked_b)], dim=1)
    place_b = torch.empty_like(ranked_b).scatter_(1, ranked_b, torch.arange(size_b, device=score.device).expand(b, size_b))
    dst2 = p + torch.gather(match2, 1, ranked_b[:, :r2])
    target = torch.gather(match1, 1, src1)  # B token of each step-1 source
    place = torch.gather(place_b, 1, target)
    dst1 = torch.where(place < r2, p + torch.gather(match2, 1, target), p + size_a + place)
    nu = size_a - r1
    src = torch.cat([torch.arange(p + nu, p + size_a, device=score.device),
                     torch.arange(p + size_a, p + size_a + r2, device=score.device)]).expand(b, count)
    return Matching(new_order, src, torch.cat([dst1, dst2], dim=1))


def fusion_weights(probs: torch.Tensor, sizes: Optional[torch.Tensor]) -> torch.Tensor:
    """MCTF's averaging weights ``[B, K]``: the attention each token receives (mean over heads and
    queries) times its size over the largest size (``utils/mctf.py:186-189``)."""
    received = probs.mean(dim=(1, 2))
    if sizes is None:
        return received
    sizes = working_precision(sizes)
    return received * sizes / sizes.amax(dim=1, keepdim=True)


def fuse(state: MergedTokens, matching: Matching, weights: torch.Tensor) -> MergedTokens:
    """The state after ``matching`` with features averaged by ``weights [B, K]`` and sizes added up."""
    b, k, _ = state.x.shape
    sizes = torch.ones(b, k, dtype=state.x.dtype, device=state.x.device) if state.sizes is None else state.sizes
    fused = apply_matching(dataclasses.replace(state, sizes=weights.to(state.x.dtype)), matching)
    return dataclasses.replace(fused, sizes=merge_values(sizes, matching))


def one_step_ahead(probs: torch.Tensor, weights: torch.Tensor, matching: Matching) -> torch.Tensor:
    """The fused tokens' attention ``[B, H, K', K']`` from the block's ``probs [B, H, K, K]``: the key
    columns of each group added, its query rows averaged with ``weights [B, K]`` (``utils/mctf.py:191-194``)."""
    b, h, k, _ = probs.shape
    k_new = k - matching.src.shape[1]
    group = positions_after_merge(*matching)  # [B, K]: the fused token each current token joins
    columns = probs.new_zeros(b, h, k, k_new).scatter_add_(3, group[:, None, None, :].expand(b, h, k, k), probs)
    rows = probs.new_zeros(b, h, k_new, k_new).scatter_add_(
        2, group[:, None, :, None].expand(b, h, k, k_new), columns * weights[:, None, :, None])
    total = weights.new_zeros(b, k_new).scatter_add_(1, group, weights)
    return rows / total[:, None, :, None]


def attention_with(split: SplitBlock, block, state: MergedTokens, probs: torch.Tensor) -> torch.Tensor:
    """The attention half of ``block`` on ``state.x [B, K, D]`` with the attention probabilities
    ``probs [B, H, K, K]`` in place of its own (the block adapter's ``attend_with``)."""
    if split.attend_with is None:
        raise PullbackError("MCTF runs a block's attention half with the fused tokens' one-step-ahead attention; "
                            "this model's block adapter has no attend_with (attention with given probabilities)")
    return split.attend_with(block, state.x, probs)


@dataclass(frozen=True)
class MCTFOptions(ToMeOptions):
    """ToMe's ``r`` (required), ``schedule`` and ``block_range`` (None: blocks 1 .. L−1, the
    authors'), and the temperatures of MCTF's three criteria, each a float >= 0 (0 leaves the
    criterion out): ``tau_sim`` (similarity), ``tau_info`` (informativeness), ``tau_size`` (size)."""

    tau_sim: float = 1.0
    tau_info: float = 20.0
    tau_size: float = 40.0

    def __post_init__(self):
        super().__post_init__()
        for name, criterion in CRITERIA.items():
            value = getattr(self, name)
            if not is_real(value) or not 0.0 <= float(value) < math.inf:
                raise PullbackError(f"{name} must be a finite float >= 0 (MCTF's temperature of its {criterion} "
                                    f"criterion; 0 leaves it out); got {value!r}")
            object.__setattr__(self, name, float(value))


class MCTF(MergingMethod):
    """MCTF (see the module docstring). Its block order differs from the contract's loop: the
    tokens fuse before the attention output, so :meth:`run` is its own and :meth:`rank` sees the
    block's *input* in ``step.state`` (with the queries and keys of its attention)."""

    name, short, title = "mctf", "MCTF", "MCTF (r tokens fused in every block from block 1)"
    options_type = MCTFOptions
    needs = Needs(split_blocks="MCTF fuses tokens inside a block, between its attention probabilities and its "
                               "attention output")
    sweep = {"r": (1, 2, 4, 6, 8, 12, 16, 20, 24)}

    def resolve(self, options, backbone: BackboneShape) -> dict:
        resolved = super().resolve(options, backbone)
        if options.block_range is None:
            if backbone.depth < 2:
                raise PullbackError("block_range: MCTF's default (blocks 1 .. L-1) leaves no block of this 1-block "
                                    "model; give block_range=(0, 1)")
            resolved["block_range"] = (1, backbone.depth)
        return resolved

    def merge_count(self, reduction, r: int, num_prefix: int, num_patch: int) -> int:
        return merge_count(r, num_prefix, num_patch)

    def describe(self, reduction) -> dict:
        o = reduction.options
        return {"method": self.name,
                "selection": f"MCTF bidirectional matching on similarity × informativeness × size (τ {o.tau_sim:g}, "
                             f"{o.tau_info:g}, {o.tau_size:g}), r per block (authors' rule; run frozen here, its "
                             f"authors fine-tune with it)",
                "averaging": "attention × size weighted, one-step-ahead attention, proportional attention"}

    def rank(self, step: MergeStep) -> Optional[Matching]:
        state = step.state
        count = merge_count(step.r, state.num_prefix, state.num_patch)
        if count == 0:
            return None
        bias = state.size_bias() if step.reduction.options.prop_attn else None
        probs = step.carry["probs"] = attention_probabilities(step.attended, bias)
        order, size_a = alternating_order(state.num_prefix, state.x.shape[1], state.x.shape[0], state.x.device)
        score = criteria_scores(state.x, probs, state.sizes, order, state.num_prefix, size_a, step.reduction.options)
        return bidirectional_matching(score, order, state.num_prefix, count)

    def fused_block(self, split: SplitBlock, block, step: MergeStep, matching: Matching) -> MergedTokens:
        """Block ``step.block`` with its tokens fused by ``matching``: attention half with the
        one-step-ahead attention, then the MLP half."""
        probs = step.carry.pop("probs")
        weights = fusion_weights(probs, step.state.sizes)
        state = fuse(step.state, matching, weights)
        x = attention_with(split, block, state, one_step_ahead(probs, weights, matching))
        return state.with_x(split.feed_forward(block, x))

    def run(self, reduction, x: torch.Tensor, loop: BlockLoop, take=()):
        merges, carry = self.block_merges(reduction), {}

        def step(i: int, block, state: MergedTokens) -> MergedTokens:
            bias = state.size_bias() if reduction.options.prop_attn else None
            if not merges[i] or merge_count(merges[i], state.num_prefix, state.num_patch) == 0:
                return state.with_x(loop.call_block(block, state, bias))
            here = MergeStep(reduction, i, state, loop.split.attend(block, state, bias), merges[i], carry)
            return self.fused_block(loop.split, block, here, self.rank(here))

        return run_tracked(MergedTokens(x=x, num_prefix=reduction.backbone.num_prefix), loop.blocks, step, take)


ORDER = 6
METHODS = (MCTF(),)
