"""Importance-guarded ToMe (``importance_tome``): ToMe's per-block bipartite merging in which a
learned per-token importance decides which tokens may be merged away, in every block that merges.

1. the importance head scores the tokens once, on the output of block ``score_layer`` (the layer
   it was trained on): ``imp = head.importance(F)`` (or ``head(F)``) ``[B, K]``, and each token
   gets the energy ``e = imp²``. Merged energies add: the energy of a merged token is the sum of
   its sources' energies (carried through every later merge; the head runs once);
2. the blocks of ``block_range`` merge, by default every block after ``score_layer``, so that no
   merge goes unguarded (a range that starts earlier merges there by ToMe's own rule, before the
   score: it reaches further, at a cost, see the findings; a token that then already stands for
   ``s`` originals is scored ``e = s · imp²``); in each, between attention and MLP, ``r``
   tokens merge (ToMe's ``r`` and ``schedule`` over the range, see
   :func:`~pullback_ext.prune.methods.merging.block_merges`, clipped as ToMe clips them), size-weighted, with
   proportional attention from the first merge on (``prop_attn``);
3. the current patch tokens alternate between sets A (even positions) and B (odd positions) as in
   ToMe; prefix tokens (CLS, registers) are never merged away nor into;
4. ``partner="bound"`` (default): each A token finds the B token of the smallest first-order error
   of merging the pair, ``((e_a s_b² + e_b s_a²) / (s_a + s_b)²)^(guard/2) · ‖k̂_a − k̂_b‖``
   (``k̂``: the block's keys averaged over heads, unit length, ToMe's metric; ``s``: sizes; the
   size-weighted average moves A by ``s_b/(s_a+s_b)`` and B by ``s_a/(s_a+s_b)`` of their
   difference, each weighted by its energy; ``guard = 1``: the bound itself).
   ``partner="cosine"``: each A token finds ToMe's match (the largest cosine of ``k̂``) and costs
   ``e_a^(guard/2) · (1 − cos)``;
5. the ``r`` A tokens of the lowest cost merge into their partner (several may share one); the
   tokens continue as ``[prefix, unmerged A (in order), B]`` as in ToMe.

``guard = 0`` merges as ToMe does (the ranking by ``1 − cos``; ties aside). Every shape follows
from ``r`` and the schedule, never from values: the whole forward compiles (``fullgraph=True``).
Full-length features (the final output and every ``take``) give every original token the features
of the token that holds it (merge-and-restore,
:meth:`~pullback_ext.prune.merged_tokens.MergedTokens.full`), which is what a dense decoder reads.

Options: ``head`` (None: every original token counts 1, and the cost is the size-weighted merge
cost alone, no head run), ``prop_attn``, and its own (:class:`ImportanceToMeOptions`; defaults
chosen on held-out photo crops, docs/importance_tome_findings.md), ``shrink`` among them: each
token's ``imp²`` moved part of the way (:data:`SHRINK`) toward its image's mean (:func:`shrunk`) before step 1's
energies, so that a head wrong about an image unlike its training scenes cannot make a merge of
dissimilar tokens nearly free.

``r`` is the one knob: with ``schedule`` and ``early_merges`` left at ``"auto"`` the method chooses
them from ``r`` when it is resolved (:func:`auto_setting`), by the FLOP ratio ToMe itself would reach
with this ``r`` in every block (:func:`tome_reach`, counted from the backbone's depth and patch
tokens): up to :data:`GUARDED_REACH` every merge guarded, constant schedule; beyond, ToMe's rule in
the blocks up to the score too (further reach, at a cost), with the constant schedule. A head on
block 0's output leaves a single block unguarded, and for it the rule has a middle setting: up to
:data:`EARLY_REACH` every merge still guarded with ToMe's decreasing schedule (the first blocks after
the score take more), beyond it the decreasing schedule with ToMe's rule in block 0. The crossovers
were chosen on held-out photo crops (docs/importance_tome_findings.md). Both fields keep ``"auto"``
in the resolved options (so that a row knows it runs the defaults); the blocks chosen are the
resolved ``block_range``. Explicit values run as given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune.matching import working_precision
from pullback_ext.prune.merged_tokens import MergedTokens
from pullback_ext.prune.methods import merging, tome
from pullback_ext.prune.methods.base import BackboneShape, Needs
from pullback_ext.prune.methods.merging import (Matching, MergeStep, MergingMethod, ToMeOptions, alternating_order,
                                                bipartite_count, key_metric, matching_from_scores, merge_values)
from pullback_ext.prune.option_checks import count, is_real
from pullback_ext.reference import guarded_ranking, pair_costs  # noqa: F401  (shared with ops.merge_step)

PARTNERS = ("cosine", "bound")
AUTO = "auto"
# The one knob's crossovers, in ToMe's FLOP ratio at r (constant schedule, every block): up to
# GUARDED_REACH every merge guarded with the constant schedule; beyond, ToMe's rule in the blocks
# before the score as well (docs/importance_tome_findings.md, §1-2). A head on block 0's output has
# one more setting: up to EARLY_REACH every merge still guarded, with the decreasing schedule, and the
# decreasing schedule beyond (§5d; for a head on block 1 and for no head, the middle setting lost
# on the demo's rendered scenes, ibid.).
GUARDED_REACH = 1.5
EARLY_REACH = 2.0
# How far each token's imp² moves toward its image's mean by default: chosen on held-out photo
# crops (110-219 of builtin:photos, CLS and depth) by the geometric mean of our matched errors over
# ToMe's (docs/importance_tome_findings.md, §5): a wrong importance on an image unlike the head's
# training scenes then cannot make a merge of dissimilar tokens nearly free.
SHRINK = 0.2
# The block a head of unknown provenance (or no head) scores: block 1's output, the docs' recipe.
DEFAULT_SCORE_LAYER = 1


def checked_shrink(value) -> float:
    """``shrink`` checked: a number in [0, 1]."""
    if not is_real(value) or not 0.0 <= float(value) <= 1.0:
        raise PullbackError(f"shrink must be a number in [0, 1] (how far the energies move toward their image's mean; "
                            f"1: no head); got {value!r}")
    return float(value)


def checked_single_head(method: str, head):
    """``head=`` of a method that takes one importance head or none, checked."""
    if head is not None and (isinstance(head, (list, tuple)) or not callable(head)):
        raise PullbackError(f"strategy {method!r} takes head= an importance head (F [B, K, D] -> [B, K]) or None; got {head!r}")
    return head


@dataclass(frozen=True)
class ImportanceToMeOptions(ToMeOptions):
    """ToMe's ``r`` (required) and ``schedule`` (``auto``: chosen from ``r``, :func:`auto_setting`);
    ``block_range``: the blocks that merge (None: every block after ``score_layer``, or every block
    with ``early_merges``); ``score_layer``: the block whose output the head scores (None: the layer
    it was trained on, :func:`head_layer`); ``guard``: the exponent of the energies in the merge cost, in [0, 8] (0:
    ToMe's own ranking); ``partner``: ``bound`` (the smallest first-order error of the pair) or
    ``cosine`` (ToMe's match); ``early_merges``: with ``block_range=None``, the blocks up to
    ``score_layer`` merge too, by ToMe's rule (further reach, at a cost); ``auto``: chosen from
    ``r`` (:func:`auto_setting`); ``shrink`` in [0, 1]: each token's ``imp²`` moved that far toward
    its image's mean ``imp²`` before it becomes an energy (:func:`shrunk`; 0: the head as it scores, 1:
    every token alike, as without a head): a bound on how cheap a wrong importance can make a merge."""

    schedule_auto = True
    schedule: Literal["constant", "decreasing", "auto"] = AUTO
    score_layer: Optional[int] = None
    guard: float = 1.0
    partner: Literal["bound", "cosine"] = "bound"
    early_merges: bool | Literal["auto"] = AUTO
    shrink: float = SHRINK

    def __post_init__(self):
        super().__post_init__()
        if not is_real(self.guard) or not 0.0 <= float(self.guard) <= 8.0:
            raise PullbackError(f"guard must be a number in [0, 8] (the energies' exponent in the merge cost); got {self.guard!r}")
        if self.partner not in PARTNERS:
            raise PullbackError(f"partner must be one of {', '.join(PARTNERS)}; got {self.partner!r}")
        if not isinstance(self.early_merges, bool) and self.early_merges != AUTO:
            raise PullbackError(f"early_merges must be True, False or 'auto' (chosen from r); got {self.early_merges!r}")
        if self.score_layer is not None:
            object.__setattr__(self, "score_layer", count("score_layer", self.score_layer, 0))
        object.__setattr__(self, "guard", float(self.guard))
        object.__setattr__(self, "shrink", checked_shrink(self.shrink))


def tome_reach(r: int, schedule: str, backbone: BackboneShape) -> float:
    """The FLOP ratio ToMe reaches with ``r`` and ``schedule`` over every block of ``backbone`` (its
    ``depth``, ``num_prefix`` and ``num_patch`` tokens), counted from the tokens each block's linear
    layers see: a ViT block of width D spends 4D² per token in attention's projections (on the
    tokens before the merge) and 8D² in an MLP of ratio 4 (on those after it), so its cost is
    ``n_attention + 2 n_mlp`` tokens whatever D is. Attention's own ``n² D`` term, the patch embedding
    and the decoder are left out: the ratio of the backbone's linear layers, the same for every decoder.
    >>> round(tome_reach(3, "constant", BackboneShape(depth=4, num_prefix=1, has_cls=True, num_patch=16)), 4)
    1.619
    """
    p, n, reduced = backbone.num_prefix, backbone.num_patch, 0
    for merges in merging.merges_per_block(r, schedule, backbone.depth):
        taken = bipartite_count(merges, p, n)
        reduced += (p + n) + 2 * (p + n - taken)
        n -= taken
    return 3 * backbone.depth * (p + backbone.num_patch) / reduced


def auto_setting(options, backbone: BackboneShape) -> tuple[str, bool]:
    """``(schedule, early_merges)`` that ``options`` run on ``backbone``; an explicit value as given,
    an ``auto`` one from ``ρ = tome_reach(r, "constant")`` (ToMe's own FLOP ratio at this ``r``):
    ``("constant", False)`` while ``ρ ≤`` :data:`GUARDED_REACH`; beyond, ``("constant", True)``, or
    for a head scoring block 0 (``score_layer``, else :func:`head_layer`) ``("decreasing", False)``
    while ``ρ ≤`` :data:`EARLY_REACH` and ``("decreasing", True)`` beyond (docs/importance_tome_findings.md)."""
    schedule, early = options.schedule, options.early_merges
    score = head_layer(options.head) if options.score_layer is None else options.score_layer
    if schedule != AUTO and early != AUTO:
        return schedule, early
    if early != AUTO and score != 0:  # the schedule of a head on any other block is constant, whatever r
        return "constant", early
    if backbone.num_patch is None:
        raise PullbackError("schedule='auto' and early_merges='auto' choose from r and the model's patch-token count, which "
                            "this model does not state; give schedule= and early_merges= explicitly")
    reach = tome_reach(options.r, "constant", backbone)
    chosen = (rule_setting(reach, GUARDED_REACH, EARLY_REACH, "decreasing", "decreasing") if score == 0 else
              rule_setting(reach, GUARDED_REACH, GUARDED_REACH, "constant", "constant"))
    return (chosen[0] if schedule == AUTO else schedule), (chosen[1] if early == AUTO else early)


def rule_setting(reach: float, guarded: float, early: float, between: str, beyond: str) -> tuple[str, bool]:
    """``(schedule, early_merges)`` of the family of one-knob rules :func:`auto_setting` is one of, where
    ToMe's own FLOP ratio at ``r`` is ``reach``: every merge guarded with the constant schedule while
    ``reach ≤ guarded``; every merge guarded with schedule ``between`` while ``reach ≤ early``; schedule
    ``beyond`` with ToMe's rule before the score beyond (benchmarks/heldout_photos.py's ``--rule``)."""
    if reach <= guarded:
        return "constant", False
    return (between, False) if reach <= early else (beyond, True)


def head_layer(head) -> int:
    """The block a head scores by default: the one it was trained on (``head.probe_layer``, which the
    checkpoint loader sets from the checkpoint's probe), else :data:`DEFAULT_SCORE_LAYER`."""
    layer = getattr(head, "probe_layer", None)
    return DEFAULT_SCORE_LAYER if layer is None else int(layer)


class Plan(NamedTuple):
    """The budget :func:`~pullback_ext.prune.methods.merging.block_merges` reads: ``r``, a ``schedule`` of
    :data:`~pullback_ext.prune.methods.merging.SCHEDULES`, ``block_range``."""

    r: int
    schedule: str
    block_range: Optional[tuple[int, int]]


class Guard(NamedTuple):
    """The guard of a run: ``head`` (None: constant importance), ``score_layer``, ``guard`` (exponent),
    ``partner``, ``shrink``."""

    head: object
    score_layer: int
    guard: float
    partner: str
    shrink: float = 0.0


def shrunk(energy: torch.Tensor, sizes: Optional[torch.Tensor], num_prefix: int, shrink: float) -> torch.Tensor:
    """``energy [B, K]`` (``size · imp²``, :func:`token_energy`) with each token's ``imp²`` moved a
    fraction ``shrink`` toward its image's mean ``imp²`` per original patch token:
    ``size · ((1 − shrink) · imp² + shrink · m)``, ``m = Σ energy / Σ size`` over the patch tokens
    (``sizes [B, K]``, None: all 1). A merge's cost then never falls below that of a token of
    ``shrink · m``, whatever the head says of it."""
    if shrink == 0.0:
        return energy
    sizes = torch.ones_like(energy) if sizes is None else sizes.to(energy.dtype)
    mean = energy[:, num_prefix:].sum(1, keepdim=True) / sizes[:, num_prefix:].sum(1, keepdim=True)
    return (1.0 - shrink) * energy + shrink * mean * sizes


def token_energy(head, x: torch.Tensor, sizes: Optional[torch.Tensor]) -> torch.Tensor:
    """Energy ``[B, K]`` of the tokens ``x [B, K, D]``: ``size · imp²`` with ``imp`` the head's
    importance (``head.importance(x)`` if it has that method, else ``head(x)``; 1 without a head) and ``sizes
    [B, K]`` (None: nothing merged yet), so that each original token of a merged one counts ``imp²``."""
    if head is None:
        energy = torch.ones(x.shape[:2], dtype=working_precision(x).dtype, device=x.device)
        return energy if sizes is None else energy * sizes.to(energy.dtype)
    method = getattr(head, "importance", None)
    imp = method(x) if callable(method) else head(x)
    if not isinstance(imp, torch.Tensor) or tuple(imp.shape) != tuple(x.shape[:2]):
        got = tuple(imp.shape) if isinstance(imp, torch.Tensor) else type(imp).__name__
        raise PullbackError(f"head must return importance of shape {tuple(x.shape[:2])}; got {got}")
    energy = working_precision(imp).to(working_precision(x).dtype).square()
    return energy if sizes is None else energy * sizes.to(energy.dtype)


def guarded_matching(state: MergedTokens, energy: torch.Tensor, keys: torch.Tensor, r: int,
                     guard: Guard) -> Optional[Matching]:
    """The guarded matching of ``r`` merges (clipped as ToMe's, :func:`~pullback_ext.prune.methods.merging.bipartite_count`)
    of ``state.x [B, K, D]`` with energies ``energy [B, K]``, matched on ``keys [B, H, K, hd]``: the
    order ``[prefix, A, B]``, the ``r`` A tokens of the lowest cost into their partner. None when nothing merges."""
    p, (b, k, _) = state.num_prefix, state.x.shape
    count = bipartite_count(r, p, k - p)
    if count == 0:
        return None
    sizes = torch.ones(b, k, dtype=state.x.dtype, device=state.x.device) if state.sizes is None else state.sizes
    return Matching(*guarded_ranking(key_metric(keys), sizes, energy, p, count, guard.guard, guard.partner))


class ImportanceToMe(MergingMethod):
    """The library's merge for every speed-up: ToMe's loop, the learned importance guarding the tokens."""

    name, short = "importance_tome", "importance-guarded ToMe"
    title = "importance-guarded ToMe (r tokens merged in every block; the learned importance decides which may go)"
    kind, head_from, head_optional = "ours", "importance", True
    options_type = ImportanceToMeOptions
    takes = ("prop_attn", "head")
    needs = Needs(split_blocks="it merges between attention and MLP")
    sweep = {"r": (2, 4, 8, 12, 16, 20, 24, 28, 32), "schedule": ("constant", "decreasing"), "early_merges": (False, True)}
    # the one knob (schedule and early_merges chosen from r): every r up to 24, so that the row has a
    # point next to each switch of the rule and a matched error is read between neighbouring r, not
    # across a stretch no r gives; then on to 48 (ToMe's own reach is r = 24 with its decreasing schedule)
    defaults_sweep = {"r": (*range(2, 25), 28, 32, 40, 48)}

    def checked_head(self, head, layers: tuple):
        return checked_single_head(self.name, head)

    def resolve(self, options, backbone: BackboneShape) -> dict:
        score = head_layer(options.head) if options.score_layer is None else options.score_layer
        if score >= backbone.depth - 1:
            raise PullbackError(f"score_layer must be a block index in [0, {backbone.depth - 2}] (a later block must merge); "
                                f"got {score}" + (" (the layer the head was trained on)" if options.score_layer is None else ""))
        choices = dict(super().resolve(options, backbone), score_layer=score)
        if options.block_range is None:
            early = auto_setting(options, backbone)[1]
            choices["block_range"] = (0 if early else score + 1, backbone.depth)
        elif options.early_merges == AUTO:
            choices["early_merges"] = False  # a given block_range leaves it nothing to choose
        return choices

    def block_merges(self, reduction) -> list[int]:
        o = reduction.options
        schedule = auto_setting(o, reduction.backbone)[0] if o.schedule == AUTO else o.schedule
        return merging.block_merges(Plan(o.r, schedule, o.block_range), reduction.backbone.depth)

    def describe(self, reduction) -> dict:
        o = reduction.options
        cost = "imp^g·(1 − cos) to ToMe's match" if o.partner == "cosine" else "the imp-weighted first-order error of the pair"
        scored = f"head on block {o.score_layer}'s output" if o.head is not None else "no head: every token counts 1"
        scored += f", imp² shrunk {o.shrink:g} toward the image's mean" if o.shrink and o.head is not None else ""
        middle = o.score_layer == 0
        blocks = (f"r per block {o.block_range}" if o.early_merges != AUTO else
                  f"r per block after block {o.score_layer} while ToMe's FLOP ratio at r is at most "
                  f"{EARLY_REACH if middle else GUARDED_REACH:g}×, in every block beyond")
        if o.schedule == AUTO:
            blocks += (f", the constant schedule while ToMe's FLOP ratio at r is at most {GUARDED_REACH:g}×, decreasing beyond"
                       if middle else ", constant schedule")
        defaults = " (defaults)" if o.schedule == AUTO and o.early_merges == AUTO else ""
        return {"method": self.name + defaults, "selection": f"lowest {cost} (g = {o.guard:g}, {scored}), {blocks}",
                "averaging": "size-weighted, proportional attention; merged tokens restored to their sources"}

    def begin(self, reduction, merges: list[int]) -> dict:
        o = reduction.options
        return {"guard": Guard(o.head, o.score_layer, o.guard, o.partner, o.shrink), "scored": any(merges), "energy": None}

    def rank(self, step: MergeStep) -> Optional[Matching]:
        energy = step.carry["energy"]
        if energy is None:  # a block_range that starts at or before score_layer: ToMe's own rule there
            return tome.bipartite_matching(step.attended.k, step.state.num_prefix, step.r)
        return guarded_matching(step.state, energy, step.attended.k, step.r, step.carry["guard"])

    def merge(self, step: MergeStep) -> MergedTokens:
        energy, guard = step.carry["energy"], step.carry["guard"]
        rule = ("tome",) if energy is None else (guard.partner, energy, guard.guard)
        fused = merging.fused_merge(step, *rule)
        if fused is None:
            return super().merge(step)
        step.carry["energy"] = fused[1]
        return fused[0]

    def apply(self, step: MergeStep, matching: Matching) -> MergedTokens:
        if step.carry["energy"] is not None:
            step.carry["energy"] = merge_values(step.carry["energy"], matching)
        return super().apply(step, matching)

    def after_block(self, reduction, block: int, state: MergedTokens, carry: dict) -> None:
        if carry["scored"] and block == carry["guard"].score_layer:  # without merges the head is not run
            guard = carry["guard"]
            energy = token_energy(guard.head, state.x, state.sizes)
            carry["energy"] = shrunk(energy, state.sizes, state.num_prefix, guard.shrink)


ORDER = 7
METHODS = (ImportanceToMe(),)
