"""ToMe as its authors run it (Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023).

In every block of ``block_range`` (default: all blocks), between attention and MLP, ``r`` tokens
merge by bipartite soft matching:

1. the current tokens alternate between sets A and B by their position in the sequence (even
   positions A, odd B, as ToMe splits the whole sequence); prefix tokens (CLS, registers) are in
   neither set: never merged away, never merged into;
2. the similarity of two tokens is the cosine of their keys averaged over heads (the keys the
   block's attention used, after any ``k_norm``);
3. each A token finds its most similar B token; the ``r`` A tokens with the highest similarity
   merge into their B match (several may share one);
4. merged features are size-weighted averages and sizes add up; the tokens continue as
   ``[prefix, unmerged A (in order), B]``, ToMe's concatenation of the two sets, which decides the
   next block's split (without a class token ToMe leaves unmerged A in similarity order; here they
   always keep their order); on a RoPE backbone a merged token keeps its destination's rotary
   position (:attr:`MergedTokens.positions`).

From the first merge on every block adds ``log(size)`` to its attention logits (proportional
attention, ``prop_attn``), inside the range and after it. ``r`` is clipped to the size of A, so at
least the prefix tokens and the B tokens (at least one) remain. Merged tokens are given back to
every source position wherever full-length features are read (:meth:`MergedTokens.full`), so
dense readers see each original token with the features of the token it was merged into, and an
average-pooling head weights a merged token by its size.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from pullback_ext import ops
from pullback_ext.errors import PullbackError
from pullback_ext.prune.matching import working_precision
from pullback_ext.prune.merged_tokens import MergedTokens, run_tracked
from pullback_ext.prune.methods.base import BackboneShape, BlockLoop, BlockLoopMethod, Needs
from pullback_ext.prune.option_checks import one_of

SCHEDULES = ("constant", "decreasing")


def merges_per_block(r: int, schedule: str, num_blocks: int) -> list[int]:
    """ToMe's ``r`` for each of ``num_blocks`` consecutive blocks.

    ``constant``: ``r`` in every block. ``decreasing``: ``r_i = floor(2r (L-1-i) / (L-1))`` for
    block ``i = 0 .. L-1`` of the ``L`` blocks, linearly from ``2r`` in the first block to 0 in the
    last (the paper's "decreasing schedule", the inflection −1 of ToMe's schedule parameter;
    computed in integers, so no rounding error moves a step); one block gets ``r``.
    >>> merges_per_block(8, "decreasing", 5)
    [16, 12, 8, 4, 0]
    """
    if schedule not in SCHEDULES:
        raise PullbackError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    if schedule == "constant" or num_blocks == 1:
        return [r] * num_blocks
    return [2 * r * (num_blocks - 1 - i) // (num_blocks - 1) for i in range(num_blocks)]


def block_merges(options, depth: int) -> list[int]:
    """Requested merges for each block ``0 .. depth-1`` of a ``depth``-block model: the schedule
    over ``options.block_range`` (``(start, stop)``, None: all blocks), 0 outside it."""
    start, stop = options.block_range if options.block_range is not None else (0, depth)
    inside = merges_per_block(options.r, options.schedule, stop - start)
    return [inside[i - start] if start <= i < stop else 0 for i in range(depth)]


def set_positions(num_prefix: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the A tokens (even) and B tokens (odd) among ``num_prefix .. k-1``."""
    first_even = num_prefix + num_prefix % 2
    first_odd = num_prefix + 1 - num_prefix % 2
    return torch.arange(first_even, k, 2, device=device), torch.arange(first_odd, k, 2, device=device)


def merge_count(r: int, num_prefix: int, num_patch: int) -> int:
    """Tokens one block merges: ``r`` clipped to ``|A|``, 0 when B is empty (a lone patch token)."""
    k = num_prefix + num_patch
    size_a = (k + 1) // 2 - (num_prefix + 1) // 2  # even positions in [num_prefix, k)
    return min(r, size_a) if num_patch - size_a > 0 else 0


def positions_after_merge(order: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``[B, K]``: where each current token is after the merge. ``order [B, K]``: the current index
    at each position of the reordered sequence; ``src``, ``dst [B, R]``: positions in it."""
    kept = torch.ones_like(order).scatter(1, src, 0)
    rank = kept.cumsum(1) - 1
    rank = rank.scatter(1, src, torch.gather(rank, 1, dst))  # a merged token goes where its match goes
    return torch.empty_like(rank).scatter(1, order, rank)


def places_after_merge(order: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``[B, K - R]``: the current index at each position of the merged sequence (the reordered
    ``order [B, K]`` without its merged-away positions ``src [B, R]``; a destination keeps its place)."""
    merged_away = torch.zeros_like(order, dtype=torch.int8).scatter(1, src, 1)
    kept = torch.argsort(merged_away, dim=1, stable=True)[:, :order.shape[1] - src.shape[1]]
    return torch.gather(order, 1, kept)


def key_metric(keys: torch.Tensor) -> torch.Tensor:
    """Unit vectors ``[B, K, hd]`` of the keys ``[B, H, K, hd]`` averaged over heads: ToMe's matching metric."""
    return torch.nn.functional.normalize(working_precision(keys.mean(dim=1)), dim=-1)


def merge_matched(state: MergedTokens, metric: torch.Tensor, order: torch.Tensor, a_start: int, size_a: int,
                  count: int) -> MergedTokens:
    """Bipartite soft matching on reordered tokens. ``order [B, K]``: the current index at each
    position of the new sequence, which ends with set A (``size_a`` positions from ``a_start``) and
    then set B; ``metric [B, K, hd]``: unit vectors of the current tokens. Each A token finds its
    most similar B token and the ``count`` A tokens with the highest similarity merge into their
    match (size-weighted); returns the state with ``K - count`` tokens in the new order."""
    ordered = torch.gather(metric, 1, order[..., None].expand(-1, -1, metric.shape[-1]))
    set_a, set_b = ordered[:, a_start:a_start + size_a], ordered[:, a_start + size_a:]
    best, match = (set_a @ set_b.transpose(1, 2)).max(dim=-1)  # [B, |A|]
    src = torch.argsort(best, dim=1, descending=True, stable=True)[:, :count]  # into A
    dst = torch.gather(match, 1, src) + a_start + size_a
    src = src + a_start
    b, k, _ = state.x.shape
    sizes = torch.ones(b, k, dtype=state.x.dtype, device=state.x.device) if state.sizes is None else state.sizes
    # index sets built from arange/argsort: valid by construction
    grouped = ops.gather_tokens(state.x, order, check_values=False)
    x, merged_sizes = ops.merge_tokens(grouped, torch.gather(sizes, 1, order), src, dst, check_values=False)
    return state.regroup(x, positions_after_merge(order, src, dst), places_after_merge(order, src),
                         sizes=merged_sizes)


def bipartite_merge(state: MergedTokens, keys: torch.Tensor, r: int) -> MergedTokens:
    """One ToMe merge of ``r`` tokens (clipped, see :func:`merge_count`) of ``state.x [B, K, D]``,
    matched on ``keys [B, H, K, hd]``; returns the state with ``K - r`` tokens ``[prefix, A, B]``."""
    p, (b, k, _) = state.num_prefix, state.x.shape
    count = merge_count(r, p, k - p)
    if count == 0:
        return state
    a_pos, b_pos = set_positions(p, k, state.x.device)
    order = torch.cat([torch.arange(p, device=state.x.device), a_pos, b_pos]).expand(b, k)
    return merge_matched(state, key_metric(keys), order, p, a_pos.numel(), count)


def run_merges(reduction, x: torch.Tensor, blocks, call_block, split, take, merge):
    """The block loop of the merging originals: in every block with merges (:func:`block_merges`
    of ``reduction.options``) ``merge(i, state, keys [B, H, K, hd], r) -> state`` runs between the
    attention and the MLP of block ``i``; proportional attention from the first merge on when
    ``prop_attn``. Returns ``(final [B, N, D], {i: features after block i [B, N, D] for i in take})``."""
    o = reduction.options
    merges = block_merges(o, reduction.backbone.depth)

    def step(i: int, block, state: MergedTokens) -> MergedTokens:
        bias = state.size_bias() if o.prop_attn else None
        if not merges[i]:
            return state.with_x(call_block(block, state, bias))
        attended = split.attend(block, state, bias)
        state = merge(i, state.with_x(attended.x), attended.k, merges[i])
        return state.with_x(split.feed_forward(block, state.x))

    return run_tracked(MergedTokens(x=x, num_prefix=reduction.backbone.num_prefix), blocks, step, take)


def run(reduction, x: torch.Tensor, blocks, call_block, split, take=()):
    """Run ``blocks`` on ``x [B, N, D]`` merging tokens as ToMe does (``reduction``: resolved
    options with ``strategy="tome"``; ``split``: a :class:`~pullback_ext.prune.split_block.SplitBlock`).
    Returns ``(final [B, N, D], {i: features after block i [B, N, D] for i in take})``, unmerged."""
    def merge(i: int, state: MergedTokens, keys: torch.Tensor, r: int) -> MergedTokens:
        return bipartite_merge(state, keys, r)

    return run_merges(reduction, x, blocks, call_block, split, take, merge)


def tokens_left(merges: list[int], num_patch: int, count) -> list[int]:
    """Patch tokens after each block when block ``i`` asks for ``merges[i]`` merges and
    ``count(r, n)`` of the ``n`` current patch tokens merge away."""
    counts = []
    for r in merges:
        num_patch -= count(r, num_patch)
        counts.append(num_patch)
    return counts


def patch_tokens_per_block(options, num_prefix: int, num_patch: int, depth: int) -> list[int]:
    """Patch tokens after each block when ToMe runs with ``options`` on ``num_patch`` patch tokens."""
    return tokens_left(block_merges(options, depth), num_patch, lambda r, n: merge_count(r, num_prefix, n))


def checked_r(r) -> Optional[int]:
    if r is not None and (not isinstance(r, numbers.Integral) or isinstance(r, bool) or r < 0):
        raise PullbackError(f"r must be None or an int >= 0 (tokens ToMe merges per block); got {r!r}")
    return None if r is None else int(r)


def checked_block_range(block_range) -> Optional[tuple[int, int]]:
    if block_range is None:
        return None
    values = tuple(block_range) if isinstance(block_range, (list, tuple)) else ()
    if (len(values) != 2 or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values)
            or not 0 <= values[0] < values[1]):
        raise PullbackError(f"block_range must be None or (start, stop) block indices with 0 <= start < stop; got {block_range!r}")
    return int(values[0]), int(values[1])


@dataclass(frozen=True)
class ToMeOptions:
    """``r``: tokens merged per block (required); ``schedule``: ``constant`` or ``decreasing`` (from
    2r to 0, :func:`merges_per_block`); ``block_range``: ``(start, stop)``, the blocks that merge
    (0-based, ``stop`` excluded; None: all)."""

    r: Optional[int] = None
    schedule: Literal["constant", "decreasing"] = "constant"
    block_range: Optional[tuple[int, int]] = None

    def __post_init__(self):
        object.__setattr__(self, "r", checked_r(self.r))
        object.__setattr__(self, "schedule", one_of("schedule", self.schedule, SCHEDULES, auto=False))
        object.__setattr__(self, "block_range", checked_block_range(self.block_range))


def resolved_block_range(options, depth: int) -> tuple[int, int]:
    """``block_range`` (None: every block) checked against a ``depth``-block model."""
    start, stop = options.block_range if options.block_range is not None else (0, depth)
    if stop > depth:
        raise PullbackError(f"block_range must end at or before block {depth} of this {depth}-block model; got {options.block_range}")
    return start, stop


class MergingMethod(BlockLoopMethod):
    """A method that merges ``r`` tokens in every block of ``block_range``, between attention and
    MLP, with proportional attention (ToMe and the methods built on its loop)."""

    takes = ("prop_attn",)
    prop_attn_applies = True
    required = ("r", "tokens merged per block")
    sweep = {"r": (1, 2, 4, 6, 8, 12, 16, 20, 24), "schedule": ("constant", "decreasing")}

    def resolve(self, options, backbone: BackboneShape) -> dict:
        return dict(super().resolve(options, backbone), block_range=resolved_block_range(options, backbone.depth))


class ToMe(MergingMethod):
    name, short, title = "tome", "ToMe", "ToMe (r tokens merged in every block)"
    options_type = ToMeOptions
    needs = Needs(split_blocks="ToMe merges between attention and MLP")
    rules = ("ToMe bipartite matching on head-mean keys, r per block (authors' rule)", "size-weighted, proportional attention")

    def run(self, reduction, x: torch.Tensor, loop: BlockLoop, take=()):
        return run(reduction, x, loop.blocks, loop.call_block, loop.split, take)

    def patch_tokens_per_block(self, reduction, num_patch: int) -> list:
        return patch_tokens_per_block(reduction.options, reduction.backbone.num_prefix, num_patch, reduction.backbone.depth)


ORDER = 1
METHODS = (ToMe(),)
