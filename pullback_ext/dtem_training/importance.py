"""importance_tome's training forward: the guarded merge relaxed as DTEM relaxes ToMe's
(:mod:`pullback_ext.dtem_training.relaxed`), so that the importance head can learn through the
merging it guards (the head's Jacobian-distilled weights as the start, the task's own distortion
as the objective: our target plus DTEM's training).

The blocks up to ``score_layer`` run as deployed (:class:`~pullback_ext.prune.methods.importance_tome.ImportanceToMe`:
nothing merges before the score, or ToMe's own rule there with ``early_merges``): no value there
depends on the head. After block ``score_layer`` the head scores the tokens (energies ``e =
shrunk(size · imp²)``, :func:`~pullback_ext.prune.methods.importance_tome.shrunk`) and the state
turns soft: ``source [B, N, K]`` the one-hot restore map of the hard merges so far, ``sizes`` and
``energy`` per current token. Every later block with a merge request merges ``r`` tokens softly
(:func:`~pullback_ext.dtem_training.relaxed.soft_merge`: A/B the alternate active tokens as ToMe splits them, DTEM's
``k2`` candidates, ``r`` softmax rounds, size-weighted averages, energies and sizes merged alike),
on the scores ``−log cost`` of the deployed rule (:func:`guarded_costs`: the pair's first-order
error ``moved^(g/2)·‖k̂_a − k̂_b‖`` with ``partner="bound"``, ``e_a^(g/2)·(1 − cos)`` with
``cosine``): the log makes the temperatures act on cost *ratios*, whatever the energies' scale.
Proportional attention (``+ log size``) as deployed. The keys are read detached (the backbone is
frozen; only the head's energies carry a gradient, through the soft selection). Full-length
features are ``S · x``, as in DTEM's relaxation.
"""

from __future__ import annotations

import torch

from pullback_ext.dtem_training.relaxed import Relaxation, Scores, SoftTokens, soft_merge
from pullback_ext.errors import PullbackError
from pullback_ext.prune.merged_tokens import MergedTokens
from pullback_ext.prune.methods.importance_tome import ImportanceToMe
from pullback_ext.prune.methods.merging import key_metric

# The temperatures of the relaxed guarded merge (scores are −log cost: tau1 · tau2 = 0.1 makes a
# cost 10% lower about e times as likely to be picked; DTEM's cosines use 0.1 · 0.1).
RELAXATION = Relaxation(k2=3, tau1=1.0, tau2=0.1)


def guarded_costs(unit_a: torch.Tensor, unit_b: torch.Tensor, e_a: torch.Tensor, e_b: torch.Tensor,
                  s_a: torch.Tensor, s_b: torch.Tensor, guard: float, partner: str) -> torch.Tensor:
    """``[B, |A|, |B|]``: the deployed merge cost of every (A, B) pair (``unit_*``: unit head-mean
    keys ``[B, |·|, hd]``; ``e_*``, ``s_*`` ``[B, |·|]``: energies and sizes; the rules of
    :func:`~pullback_ext.prune.methods.importance_tome.pair_costs`, before its minimum over B)."""
    cos = unit_a @ unit_b.transpose(1, 2)
    if partner == "cosine":
        return e_a[:, :, None].pow(guard / 2) * (1 - cos)
    dist = (2 - 2 * cos).clamp_min(0).sqrt()
    total = s_a[:, :, None] + s_b[:, None, :]
    moved = (e_a[:, :, None] * s_b[:, None, :].square() + e_b[:, None, :] * s_a[:, :, None].square()) / total.square()
    return moved.pow(guard / 2) * dist


def log_cost_scores(keys: torch.Tensor, guard: float, partner: str) -> Scores:
    """The relaxation's scores ``−log cost`` (:func:`guarded_costs`) of a soft state, matched on the
    keys ``[B, H, K, hd]`` of its current tokens (read detached)."""
    unit = key_metric(keys.detach())

    def scores(tokens: SoftTokens, a: slice, b: slice) -> torch.Tensor:
        e, s = tokens.energy.to(unit.dtype), tokens.sizes.to(unit.dtype)
        cost = guarded_costs(unit[:, a], unit[:, b], e[:, a], e[:, b], s[:, a], s[:, b], guard, partner)
        return -cost.clamp_min(torch.finfo(cost.dtype).tiny).log()

    return scores


def soft_state(state: MergedTokens, energy: torch.Tensor, num_tokens: int) -> SoftTokens:
    """The soft state of the hard ``state`` (``x [B, K, D]``) of ``num_tokens`` original tokens, with
    the energies ``energy [B, K]``: ``source`` the one-hot restore map ``[B, N, K]``."""
    b, k, _ = state.x.shape
    holders = state.holders()
    source = torch.zeros(b, num_tokens, k, dtype=state.x.dtype, device=state.x.device).scatter(2, holders[..., None], 1.0)
    sizes = state.x.new_ones(b, k) if state.sizes is None else state.sizes.to(state.x.dtype)
    return SoftTokens(x=state.x, sizes=sizes, source=source, active=k, energy=energy)


class RelaxedImportanceToMe(ImportanceToMe):
    """importance_tome with the training forward (see the module docstring) in place of the deployed
    loop: the same schedule, blocks and guard, the merges after the score relaxed. One forward at a
    time per instance (the deployed blocks' carry is kept on it between them)."""

    def __init__(self, relax: Relaxation = RELAXATION):
        self.relax, self.carry = relax, None

    def begin(self, reduction, merges: list[int]) -> dict:
        # the head runs at the score even when no later block merges: it is what trains
        self.carry = super().begin(reduction, merges) | {"scored": True}
        return self.carry

    def after_block(self, reduction, block: int, state: MergedTokens, carry: dict) -> None:
        super().after_block(reduction, block, state, carry)
        carry["state"] = state

    def run(self, reduction, x: torch.Tensor, loop, take=()):
        o = reduction.options
        if o.head is None:
            raise PullbackError("the relaxed importance_tome forward trains a head: give head=")
        if not o.prop_attn:
            raise PullbackError("the relaxed importance_tome forward runs with proportional attention (prop_attn=True)")
        merges, score, p = self.block_merges(reduction), o.score_layer, reduction.backbone.num_prefix
        _, taken = super().run(reduction, x, loop._replace(blocks=loop.blocks[:score + 1]), take)
        carry, tiny = self.carry, torch.finfo(x.dtype).tiny
        tokens = soft_state(carry["state"], carry["energy"], x.shape[1])
        for i in range(score + 1, len(loop.blocks)):
            block = loop.blocks[i]
            bias = tokens.sizes.clamp_min(tiny).log()[:, None, None, :]
            attended = loop.split.attend(block, MergedTokens(x=tokens.x, num_prefix=p), bias)
            tokens = tokens._replace(x=attended.x)
            if merges[i]:
                scores = log_cost_scores(attended.k, carry["guard"].guard, carry["guard"].partner)
                tokens = soft_merge(tokens, scores, p, merges[i], self.relax, tome_split=True)
            tokens = tokens._replace(x=loop.split.feed_forward(block, tokens.x))
            if i in take:
                taken[i] = tokens.full()
        return tokens.full(), taken
