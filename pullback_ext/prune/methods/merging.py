"""The contract of per-block merging: ToMe's block loop, with what each method decides (its
*ranking*) apart from what every one of them does with it (*applying*).

In every block with a merge request (:meth:`MergingMethod.block_merges`), between the attention and
the MLP, the method's :meth:`MergingMethod.rank` looks at a :class:`MergeStep` (the tokens after the
attention half, the keys and queries that attention used, the request ``r``) and answers a
:class:`Matching`: a reordering of the current tokens and, in it, which tokens merge into which.
:func:`apply_matching` then does the rest, the same for every method: the tokens gathered into the
new order, the merged ones averaged (:func:`size_weighted` unless the method supplies its own
``average``), sizes added up, and the maps that give every original token back its features
(merge-and-restore) and its rotary position. Proportional attention (``log(size)`` on the logits
from the first merge on, ``prop_attn``) is the loop's. A method's options subclass
:class:`ToMeOptions` when it takes ToMe's ``r``, ``schedule`` and ``block_range``.

ToMe (:mod:`.tome`) ranks A tokens by their best key cosine to B; PiToMe (:mod:`.pitome`) orders
the tokens by energy first; importance_tome (:mod:`.importance_tome`) by a guarded merge cost.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple, Optional

import torch

from pullback_ext import ops, reference
from pullback_ext.errors import PullbackError
from pullback_ext.prune.merged_tokens import MergedTokens, run_tracked
from pullback_ext.prune.methods.base import BackboneShape, BlockLoop, BlockLoopMethod, Reduction
from pullback_ext.prune.option_checks import one_of
from pullback_ext.prune.split_block import Attended
# The unfused path's pieces (the pure-torch reference of ops.merge_step is made of them).
from pullback_ext.reference import (alternating_order, best_match, bipartite_count, key_metric,  # noqa: F401
                                    places_after_merge, positions_after_merge)

SCHEDULES = ("constant", "decreasing")


# the schedule

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


def tokens_left(merges: list[int], num_patch: int, count) -> list[int]:
    """Patch tokens after each block when block ``i`` asks for ``merges[i]`` merges and
    ``count(r, n)`` of the ``n`` current patch tokens merge away."""
    counts = []
    for r in merges:
        num_patch -= count(r, num_patch)
        counts.append(num_patch)
    return counts


def checked_r(r) -> Optional[int]:
    if r is not None and (not isinstance(r, numbers.Integral) or isinstance(r, bool) or r < 0):
        raise PullbackError(f"r must be None or an int >= 0 (tokens merged per block); got {r!r}")
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
    (0-based, ``stop`` excluded; None: all). The options of every method that takes ToMe's budget
    subclass it (their own fields after these, checked in ``__post_init__`` after ``super()``'s);
    one whose method chooses the schedule at resolve time sets ``schedule_auto`` (``"auto"`` allowed)."""

    schedule_auto: ClassVar[bool] = False
    r: Optional[int] = None
    schedule: Literal["constant", "decreasing"] = "constant"
    block_range: Optional[tuple[int, int]] = None

    def __post_init__(self):
        object.__setattr__(self, "r", checked_r(self.r))
        object.__setattr__(self, "schedule", one_of("schedule", self.schedule, SCHEDULES, auto=self.schedule_auto))
        object.__setattr__(self, "block_range", checked_block_range(self.block_range))


def resolved_block_range(options, depth: int) -> tuple[int, int]:
    """``block_range`` (None: every block) checked against a ``depth``-block model."""
    start, stop = options.block_range if options.block_range is not None else (0, depth)
    if stop > depth:
        raise PullbackError(f"block_range must end at or before block {depth} of this {depth}-block model; got {options.block_range}")
    return start, stop


# ranking

class Matching(NamedTuple):
    """What a ranking decides in one block. ``order [B, K]`` (int64): the current index at each
    position of the reordered sequence (the prefix tokens first, in place); ``src``, ``dst [B, R]``
    (int64): positions in that sequence, the token at ``src[:, j]`` merges into the one at
    ``dst[:, j]`` (a destination is never merged away; several may share one). The tokens continue
    in the reordered sequence without the ``src`` positions."""

    order: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor


class MergeStep(NamedTuple):
    """What a ranking sees in block ``block``: ``reduction`` (the resolved options), ``state`` (the
    tokens after the block's attention half), ``attended`` (the queries, keys and logit scale that
    attention used), ``r`` (the merges the schedule asks for here) and ``carry`` (the method's
    per-forward scratch, made by :meth:`MergingMethod.begin`)."""

    reduction: Reduction
    block: int
    state: MergedTokens
    attended: Attended
    r: int
    carry: dict


def matching_from_scores(order: torch.Tensor, a_start: int, size_a: int, score: torch.Tensor, match: torch.Tensor,
                         count: int, descending: bool = True) -> Matching:
    """ToMe's rule on a split sequence ``order [B, K]`` ending with set A (``size_a`` positions from
    ``a_start``) and then set B: the ``count`` A tokens of the highest ``score [B, |A|]`` (lowest
    with ``descending=False``; ties by position) merge into their ``match [B, |A|]`` (an index into B)."""
    return Matching(*reference.matching_from_scores(order, a_start, size_a, score, match, count, descending))


# applying

def size_weighted(x: torch.Tensor, sizes: torch.Tensor, src: torch.Tensor, dst: torch.Tensor):
    """The merge every method but ToFu uses: ``(x [B, K - R, D], sizes [B, K - R])`` from the
    reordered tokens ``x [B, K, D]`` and ``sizes [B, K]``, each destination the size-weighted mean
    of itself and its sources, sizes added up."""
    # index sets of a Matching are built from arange/argsort: valid by construction
    return ops.merge_tokens(x, sizes, src, dst, check_values=False)


def apply_matching(state: MergedTokens, matching: Matching, average=size_weighted) -> MergedTokens:
    """The state after ``matching`` on ``state.x [B, K, D]``: ``K - R`` tokens, merged by
    ``average`` (see :func:`size_weighted`), with the maps of every original token and position."""
    order, src, dst = matching
    b, k, _ = state.x.shape
    sizes = torch.ones(b, k, dtype=state.x.dtype, device=state.x.device) if state.sizes is None else state.sizes
    grouped = ops.gather_tokens(state.x, order, check_values=False)
    x, merged_sizes = average(grouped, torch.gather(sizes, 1, order), src, dst)
    return state.regroup(x, positions_after_merge(order, src, dst), places_after_merge(order, src), sizes=merged_sizes)


def merge_values(values: torch.Tensor, matching: Matching) -> torch.Tensor:
    """An additive per-token quantity ``values [B, K]`` (e.g. energies) after ``matching``: ``[B, K - R]``,
    each destination's the sum of its own and its sources'."""
    order, src, dst = matching
    ordered = torch.gather(values, 1, order)
    return ops.merge_tokens(torch.ones_like(ordered[..., None]), ordered, src, dst, check_values=False)[1]


# fused: one compiled op per merge

# Whether a method whose ranking the fused op covers runs its merges as one call of
# ops.merge_step (where the compiled op takes the tokens); False: always the unfused path (rank,
# then apply_matching), which stays the reference. Read at every merge.
FUSED = True


def fused_merge(step: MergeStep, rule: str, energy: Optional[torch.Tensor] = None, guard: float = 0.0,
                margin: float = 0.0, alpha: float = 1.0) -> Optional[tuple[MergedTokens, Optional[torch.Tensor]]]:
    """``(state, energy)`` after the block's merge by ``rule`` (see ``ops.merge_step``) in one compiled
    call, the energies ``energy [B, K]`` (None: not carried) merged along; None where the unfused
    path runs instead: :data:`FUSED` off, tokens the compiled op does not take, extra tokens, or a
    gradient asked of the tokens, keys, sizes or energies (the op is forward-only)."""
    state, keys = step.state, step.attended.k
    x, sizes = state.x, state.sizes
    tensors = [t for t in (x, keys, sizes, energy) if t is not None]
    if (not FUSED or state.num_extra or not ops.merge_step_compiled(x) or keys.dim() != 4 or keys.dtype != x.dtype
            or (energy is not None and energy.dtype != reference.working_precision(x).dtype)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
        return None
    if reference.merge_step_count(rule, step.r, state.num_prefix, x.shape[1]) == 0:
        return state, energy
    # the compiled op itself, not ops.merge_step: its kernel checks every shape, dtype and device
    # again, naming the argument, and this runs once per merging block
    x, sizes, merged_energy, owner, positions = torch.ops.pullback_ext.merge_step(
        x, keys, sizes, energy, state.owner, state.positions, state.num_prefix, step.r, rule, float(guard),
        float(margin), float(alpha))
    return (MergedTokens(x=x, num_prefix=state.num_prefix, owner=owner, sizes=sizes, positions=positions),
            None if energy is None else merged_energy)


# the loop

class MergingMethod(BlockLoopMethod):
    """A method that merges tokens between attention and MLP in the blocks its schedule names, with
    proportional attention: ToMe and the methods built on its loop. A subclass supplies
    :meth:`rank`; it may supply ``average`` (a staticmethod like :func:`size_weighted`),
    :meth:`block_merges`, :meth:`merge_count` (its schedule and how many tokens a request takes),
    :meth:`begin`, :meth:`after_block` and :meth:`apply` (what it carries along, e.g. energies)."""

    takes = ("prop_attn",)
    prop_attn_applies = True
    required = ("r", "tokens merged per block")
    sweep = {"r": (1, 2, 4, 6, 8, 12, 16, 20, 24), "schedule": ("constant", "decreasing")}
    average = staticmethod(size_weighted)

    def resolve(self, options, backbone: BackboneShape) -> dict:
        return dict(super().resolve(options, backbone), block_range=resolved_block_range(options, backbone.depth))

    def block_merges(self, reduction: Reduction) -> list[int]:
        """The merge request of each block (0: the block runs unchanged)."""
        return block_merges(reduction.options, reduction.backbone.depth)

    def merge_count(self, reduction: Reduction, r: int, num_prefix: int, num_patch: int) -> int:
        """Tokens a request ``r`` merges away among ``num_patch`` current patch tokens."""
        return bipartite_count(r, num_prefix, num_patch)

    def rank(self, step: MergeStep) -> Optional[Matching]:
        """The block's matching, or None for no merge."""
        raise NotImplementedError

    def begin(self, reduction: Reduction, merges: list[int]) -> dict:
        """The per-forward carry, before the first block (``merges``: :meth:`block_merges`)."""
        return {}

    def after_block(self, reduction: Reduction, block: int, state: MergedTokens, carry: dict) -> None:
        """After every block, on its output tokens."""

    def apply(self, step: MergeStep, matching: Matching) -> MergedTokens:
        return apply_matching(step.state, matching, self.average)

    def merge(self, step: MergeStep) -> MergedTokens:
        """The block's merge: :meth:`rank`, then :meth:`apply` (a method whose ranking
        :func:`fused_merge` covers runs it as one op there)."""
        matching = self.rank(step)
        return step.state if matching is None else self.apply(step, matching)

    def run(self, reduction: Reduction, x: torch.Tensor, loop: BlockLoop, take=()):
        prop_attn, merges = reduction.options.prop_attn, self.block_merges(reduction)
        carry = self.begin(reduction, merges)

        def step(i: int, block, state: MergedTokens) -> MergedTokens:
            bias = state.size_bias() if prop_attn else None
            if not merges[i]:
                state = state.with_x(loop.call_block(block, state, bias))
            else:
                attended = loop.split.attend(block, state, bias)
                here = MergeStep(reduction, i, state.with_x(attended.x), attended, merges[i], carry)
                state = self.merge(here)
                state = state.with_x(loop.split.feed_forward(block, state.x))
            self.after_block(reduction, i, state, carry)
            return state

        return run_tracked(MergedTokens(x=x, num_prefix=reduction.backbone.num_prefix), loop.blocks, step, take)

    def patch_tokens_per_block(self, reduction: Reduction, num_patch: int) -> list:
        p = reduction.backbone.num_prefix
        return tokens_left(self.block_merges(reduction), num_patch, lambda r, n: self.merge_count(reduction, r, p, n))
