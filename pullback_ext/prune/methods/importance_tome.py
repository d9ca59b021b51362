"""Importance-guarded ToMe (``importance_tome``): ToMe's per-block bipartite merging in which a
learned per-token importance decides which tokens may be merged away.

In every block of ``block_range`` (default: all blocks), between attention and MLP, ``r`` tokens
merge (ToMe's ``r`` and ``schedule``, see :func:`~pullback_ext.prune.methods.tome.block_merges`; the same
count per block as ToMe, :func:`patch_tokens_per_block`), size-weighted, with proportional
attention from the first merge on (``prop_attn``):

1. the importance head scores the tokens once, on the output of block ``score_layer`` (the layer
   it was trained on): ``imp = head.importance(F)`` (or ``head(F)``) ``[B, K]``; a token that
   already stands for ``s`` original tokens gets the energy ``e = s · imp²``, so that every
   original token counts ``imp²``. Merged energies add: the energy of a merged token is the sum of
   its sources' energies. Blocks up to ``score_layer`` merge by ToMe's own rule (no score yet);
2. in the later blocks the current patch tokens alternate between sets A (even positions) and B
   (odd positions) as in ToMe; prefix tokens (CLS, registers) are never merged away nor into;
3. ``partner="cosine"``: each A token finds the B token with the largest cosine of the head-mean
   keys (ToMe's match) and costs ``e_a^(guard/2) · (1 − cos)``. ``partner="bound"``: each A token
   finds the B token of the smallest first-order error of merging the pair,
   ``((e_a s_b² + e_b s_a²) / (s_a + s_b)²)^(guard/2) · ‖k̂_a − k̂_b‖`` (``k̂``: the unit head-mean
   keys, ``s``: sizes; the size-weighted average moves A by ``s_b/(s_a+s_b)`` and B by
   ``s_a/(s_a+s_b)`` of their difference, each weighted by its energy; ``guard = 1``: the bound);
4. the ``r`` A tokens of the lowest cost merge into their partner (several may share one); the
   tokens continue as ``[prefix, unmerged A (in order), B]`` as in ToMe.

``guard = 0`` is ToMe itself (the ranking by ``1 − cos``; ties aside).
Every shape follows from ``r`` and the schedule, never from values: the whole forward compiles
(``fullgraph=True``). Full-length features (the final output and every ``take``) give every
original token the features of the token that holds it (merge-and-restore,
:meth:`~pullback_ext.prune.merged_tokens.MergedTokens.full`), which is what a dense decoder reads.

Options: ``head`` and ``prop_attn``, and its own (:class:`ImportanceToMeOptions`; defaults chosen
on held-out images, docs/importance_tome_findings.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional

import torch

from pullback_ext import ops
from pullback_ext.errors import PullbackError
from pullback_ext.prune.matching import working_precision
from pullback_ext.prune.merged_tokens import MergedTokens
from pullback_ext.prune.methods import tome
from pullback_ext.prune.methods.base import BackboneShape, BlockLoop, Needs
from pullback_ext.prune.option_checks import count, is_real

PARTNERS = ("cosine", "bound")


@dataclass(frozen=True)
class ImportanceToMeOptions:
    """ToMe's ``r`` (required), ``schedule`` and ``block_range``; ``score_layer``: the block whose
    output the head scores (the layer it was trained on); ``guard``: the exponent of the energy in
    the merge cost, in [0, 8] (0: ToMe's own ranking); ``partner``: ``cosine`` (ToMe's match) or
    ``bound`` (the smallest first-order error of the pair)."""

    r: Optional[int] = None
    schedule: Literal["constant", "decreasing"] = "constant"
    block_range: Optional[tuple[int, int]] = None
    score_layer: int = 1
    guard: float = 1.0
    partner: Literal["cosine", "bound"] = "cosine"

    def __post_init__(self):
        tome.ToMeOptions.__post_init__(self)
        if not is_real(self.guard) or not 0.0 <= float(self.guard) <= 8.0:
            raise PullbackError(f"guard must be a number in [0, 8] (the energy's exponent in the merge cost); got {self.guard!r}")
        if self.partner not in PARTNERS:
            raise PullbackError(f"partner must be one of {', '.join(PARTNERS)}; got {self.partner!r}")
        object.__setattr__(self, "score_layer", count("score_layer", self.score_layer, 0))
        object.__setattr__(self, "guard", float(self.guard))


class Guard(NamedTuple):
    """The guard of a run: ``head``, ``score_layer``, ``guard`` (exponent), ``partner``."""

    head: object
    score_layer: int
    guard: float
    partner: str


def token_energy(head, x: torch.Tensor, sizes: Optional[torch.Tensor]) -> torch.Tensor:
    """Energy ``[B, K]`` of the tokens ``x [B, K, D]``: ``size · imp²`` with ``imp`` the head's
    importance (``head.importance(x)`` if it has that method, else ``head(x)``) and ``sizes [B, K]``
    (None: every token is one original token)."""
    method = getattr(head, "importance", None)
    imp = method(x) if callable(method) else head(x)
    if not isinstance(imp, torch.Tensor) or tuple(imp.shape) != tuple(x.shape[:2]):
        got = tuple(imp.shape) if isinstance(imp, torch.Tensor) else type(imp).__name__
        raise PullbackError(f"head must return importance of shape {tuple(x.shape[:2])}; got {got}")
    energy = working_precision(imp).to(working_precision(x).dtype).square()
    return energy if sizes is None else energy * sizes.to(energy.dtype)


def pair_costs(metric_a: torch.Tensor, metric_b: torch.Tensor, e_a: torch.Tensor, e_b: torch.Tensor,
               s_a: torch.Tensor, s_b: torch.Tensor, guard: float, partner: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cost [B, |A|], match [B, |A|])``: each A token's merge cost and its partner in B.

    ``metric_a [B, |A|, hd]``, ``metric_b [B, |B|, hd]``: unit head-mean keys; ``e_*``, ``s_*``
    ``[B, |A|]`` / ``[B, |B|]``: energies and sizes (see the module docstring for the two rules)."""
    cos = metric_a @ metric_b.transpose(1, 2)  # [B, |A|, |B|]
    if partner == "cosine":
        best, match = cos.max(dim=-1)
        return e_a.pow(guard / 2) * (1 - best), match
    dist = (2 - 2 * cos).clamp_min(0).sqrt()
    total = s_a[:, :, None] + s_b[:, None, :]
    moved = (e_a[:, :, None] * s_b[:, None, :].square() + e_b[:, None, :] * s_a[:, :, None].square()) / total.square()
    return (moved.pow(guard / 2) * dist).min(dim=-1)


def guarded_merge(state: MergedTokens, energy: torch.Tensor, keys: torch.Tensor, r: int,
                  guard: Guard) -> tuple[MergedTokens, torch.Tensor]:
    """One guarded merge of ``r`` tokens (clipped as ToMe, :func:`~pullback_ext.prune.methods.tome.merge_count`)
    of ``state.x [B, K, D]`` with energies ``energy [B, K]``, matched on ``keys [B, H, K, hd]``;
    returns the state with ``K - r`` tokens ``[prefix, A, B]`` and their energies ``[B, K - r]``."""
    p, (b, k, _) = state.num_prefix, state.x.shape
    count = tome.merge_count(r, p, k - p)
    if count == 0:
        return state, energy
    a_pos, b_pos = tome.set_positions(p, k, state.x.device)
    size_a = a_pos.numel()
    order = torch.cat([torch.arange(p, device=state.x.device), a_pos, b_pos]).expand(b, k)
    metric = torch.gather(tome.key_metric(keys), 1, order[..., None].expand(-1, -1, keys.shape[-1]))
    sizes = torch.ones(b, k, dtype=state.x.dtype, device=state.x.device) if state.sizes is None else state.sizes
    sizes, energy = torch.gather(sizes, 1, order), torch.gather(energy, 1, order)
    work_sizes = sizes.to(metric.dtype)
    a, bb = slice(p, p + size_a), slice(p + size_a, k)
    cost, match = pair_costs(metric[:, a], metric[:, bb], energy[:, a], energy[:, bb], work_sizes[:, a], work_sizes[:, bb],
                             guard.guard, guard.partner)
    src = torch.argsort(cost, dim=1, stable=True)[:, :count]  # into A, cheapest first
    dst = torch.gather(match, 1, src) + p + size_a
    src = src + p
    # index sets built from arange/argsort: valid by construction
    grouped = ops.gather_tokens(state.x, order, check_values=False)
    x, merged_sizes = ops.merge_tokens(grouped, sizes, src, dst, check_values=False)
    _, merged_energy = ops.merge_tokens(torch.ones_like(energy[..., None]), energy, src, dst, check_values=False)
    merged = state.regroup(x, tome.positions_after_merge(order, src, dst), tome.places_after_merge(order, src),
                           sizes=merged_sizes)
    return merged, merged_energy


def run(reduction, x: torch.Tensor, blocks, call_block, split, take=()):
    """Run ``blocks`` on ``x [B, N, D]`` merging tokens under the importance guard (``reduction``:
    resolved options with ``strategy="importance_tome"``; ``split``: a
    :class:`~pullback_ext.prune.split_block.SplitBlock`). Returns ``(final [B, N, D], {i: features
    after block i [B, N, D] for i in take})``, every original token restored from the token that
    holds it."""
    o = reduction.options
    depth = reduction.backbone.depth
    merges = tome.block_merges(o, depth)
    guard = Guard(o.head, o.score_layer, o.guard, o.partner)
    scored = any(merges[guard.score_layer + 1:])  # without later merges the head is not run
    state, energy, taken = MergedTokens(x=x, num_prefix=reduction.backbone.num_prefix), None, {}
    for i, block in enumerate(blocks):
        bias = state.size_bias() if o.prop_attn else None
        if not merges[i]:
            state = state.with_x(call_block(block, state, bias))
        else:
            attended = split.attend(block, state, bias)
            state = state.with_x(attended.x)
            if energy is None:
                state = tome.bipartite_merge(state, attended.k, merges[i])
            else:
                state, energy = guarded_merge(state, energy, attended.k, merges[i], guard)
            state = state.with_x(split.feed_forward(block, state.x))
        if scored and i == guard.score_layer:
            energy = token_energy(guard.head, state.x, state.sizes)
        if i in take:
            taken[i] = state.full()
    return state.full(), taken


def patch_tokens_per_block(options, num_prefix: int, num_patch: int, depth: int) -> list[int]:
    """Patch tokens after each block when ``importance_tome`` runs with ``options`` on ``num_patch``
    patch tokens (ToMe's counts: the guard changes which tokens merge, not how many)."""
    return tome.patch_tokens_per_block(options, num_prefix, num_patch, depth)


class ImportanceToMe(tome.MergingMethod):
    """The library's merge for every speed-up: ToMe's loop, the learned importance guarding the tokens."""

    name, short = "importance_tome", "importance-guarded ToMe"
    title = "importance-guarded ToMe (r tokens merged in every block; the learned importance decides which may go)"
    kind, ours, head_from = "ours", True, "importance"
    options_type = ImportanceToMeOptions
    takes = ("prop_attn", "head")
    needs = Needs(split_blocks="it merges between attention and MLP")

    def checked_head(self, head, layers: tuple):
        if head is None or isinstance(head, (list, tuple)) or not callable(head):
            raise PullbackError(f"strategy 'importance_tome' needs head= (an importance head, F [B, K, D] -> [B, K]); got {head!r}")
        return head

    def resolve(self, options, backbone: BackboneShape) -> dict:
        if options.score_layer >= backbone.depth:
            raise PullbackError(f"score_layer must be a block index in [0, {backbone.depth - 1}]; got {options.score_layer}")
        return super().resolve(options, backbone)

    def describe(self, reduction) -> dict:
        o = reduction.options
        rule = "imp^g·(1 − cos) to the ToMe match" if o.partner == "cosine" else "imp-weighted first-order error of the pair"
        return {"method": self.name,
                "selection": f"lowest {rule} (g = {o.guard:g}, head on block {o.score_layer}'s output), r per block",
                "averaging": "size-weighted, proportional attention; merged tokens restored to their sources"}

    def run(self, reduction, x: torch.Tensor, loop: BlockLoop, take=()):
        return run(reduction, x, loop.blocks, loop.call_block, loop.split, take)

    def patch_tokens_per_block(self, reduction, num_patch: int) -> list:
        return patch_tokens_per_block(reduction.options, reduction.backbone.num_prefix, num_patch, reduction.backbone.depth)


ORDER = 7
METHODS = (ImportanceToMe(),)
