"""TAP trained: the same block loop on the full-length sequence, with a straight-through top-k.

Relaxation: straight-through (ST) top-k with a sigmoid surrogate. The forward pass takes exactly
the deployed decision — at each eligible layer the same integer count (largest remainder of the
batch-mean shares) of lowest-scoring live tokens is removed, so the budget is exact in training
too — while the gradient is that of a soft keep mask ``m_t = σ((s_t − τ)/T)``: ``τ`` interpolates
the sorted live scores at the fractional position ``c = share·(tokens still to remove)`` of the
image's own share, so the scores *and* the shares get gradients; ``T`` is a fraction of the scores'
spread. Why ST: the forward must be the deployed hard selection (exact counts, the pruned model's
real outputs) and costs one sort; perturbed top-k needs many forward passes per step, Sinkhorn top-k
an inner loop and a temperature schedule and its forward is soft unless made ST as well.

The live mask ``a`` (value 0/1, ST gradient) enters twice: as the attention bias ``log(a + ε)`` on
the keys (a removed token is invisible, as if gathered out), and in ``x_t ← a_t·x_t + (1 − a_t)·f_t``
with ``f_t`` the feature the token was (or would be) frozen at — its recovered feature at the last
eligible layer (:func:`pullback_ext.prune.recovery.recover`, dense) — so that a removed token is read
with its frozen feature. Values equal the deployed loop's (:mod:`pullback_ext.prune.methods.tap`) up to the
``ε``-leak of the bias.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from pullback_ext.grids import grid_shape
from pullback_ext.prune.recovery import recover
from pullback_ext.tap.budget import BudgetPlan
from pullback_ext.tap.register import TaskRegister
from pullback_ext.prune.methods.tap import check_fits
from pullback_ext.tap.tokens import batch_shares, strip_register

TEMPERATURE = 0.5  # of the soft mask, as a fraction of the live scores' standard deviation
LEAK = 1e-12  # ε of the attention bias log(a + ε)


def soft_keep(scores: torch.Tensor, live: torch.Tensor, count: int, fractional: torch.Tensor) -> torch.Tensor:
    """Straight-through keep mask ``[B, n]`` (value 0/1): the ``count`` lowest-scoring ``live
    [B, n]`` (bool) tokens go (the same number of live tokens per image); gradient of the sigmoid
    surrogate thresholded at ``fractional [B]`` tokens. Dead tokens stay 0."""
    dead = int((~live[0]).sum())
    masked = scores.masked_fill(~live, float("-inf"))
    order = masked.sort(dim=1)
    hard = torch.ones_like(scores).scatter(1, order.indices[:, : dead + count], 0.0)
    n = scores.shape[1]
    position = (dead + fractional - 0.5).clamp(min=dead, max=n - 1)
    low = position.detach().floor().long()
    frac = position - low
    sorted_scores = order.values
    tau = (1 - frac) * sorted_scores.gather(1, low[:, None])[:, 0] + frac * sorted_scores.gather(1, (low + 1).clamp(max=n - 1)[:, None])[:, 0]
    spread = scores.masked_fill(~live, 0).detach().std(dim=1, keepdim=True).clamp_min(1e-6)
    soft = torch.sigmoid((scores - tau[:, None]) / (TEMPERATURE * spread))
    return torch.where(live, hard + soft - soft.detach(), torch.zeros_like(soft))


def _bias(live_st: torch.Tensor, prefix: int, llf: bool) -> torch.Tensor:
    """Attention bias ``[B, 1, 1|K, K]``: ``log(a + ε)`` on the patch keys; under LLF only for the
    queries that are live (the re-inserted tokens see everything, as in masked LLF)."""
    b = live_st.shape[0]
    keys = torch.cat([live_st.new_ones(b, prefix), live_st], dim=1)
    bias = (keys + LEAK).log()[:, None, None, :]
    if not llf:
        return bias
    queries = torch.cat([live_st.new_ones(b, prefix), live_st.detach()], dim=1)
    return bias * queries[:, None, :, None]


def run_relaxed(register: TaskRegister, x: torch.Tensor, blocks: Sequence, call_block: Callable, num_prefix: int, rho: float,
                take=(), share_mean: Callable = batch_shares):
    """Training forward of TAP on ``x [B, N, D]`` (block-0 input) at keep rate ``rho``; ``call_block(block,
    state, bias)`` as in :func:`pullback_ext.prune.pipeline.run_blocks` (``state.x``: all tokens);
    ``share_mean``: shares ``[B, L − j]`` -> the batch's shares (DDP: averaged over the ranks too).
    Returns ``(final [B, N, D], {i: [B, N, D]})`` like :func:`pullback_ext.prune.methods.tap.run`."""
    p, depth = num_prefix, len(blocks)
    check_fits(register, depth)
    q, n = p + 1, x.shape[1] - p
    grid = grid_shape(n)
    plan = BudgetPlan(n, rho, register.num_layers)
    call = register.block_caller(call_block)
    x = register.insert(x, p)
    live_st = x.new_ones(x.shape[0], n)
    frozen = x[:, q:]
    taken = {}
    for i, block in enumerate(blocks):
        stage = register.stage(i)
        if stage is not None:
            read = register.read(stage, x[:, p], x[:, q:], rho)
            remaining = plan.remaining
            count = plan.take(stage, share_mean(read.shares))
            live_before = live_st.detach() > 0.5
            keep = soft_keep(read.scores, live_before, count, read.shares[:, 0] * remaining)
            candidate = x[:, q:] if read.alpha is None else recover(x[:, q:], keep.detach() > 0.5, grid, read.alpha[:, None, None])
            frozen = torch.where(live_before[..., None], candidate, frozen)
            live_st = live_st * keep
        llf = register.task == "depth" and i == depth - 1
        tokens = _Tokens(x, q, None if llf else (live_st, frozen))
        x = tokens.full(call(i, block, tokens, _bias(live_st, q, llf)))
        if i in take:
            taken[i] = strip_register(x, p)
    return strip_register(x, p), taken


class _Tokens:
    """The token state ``call_block`` is handed: ``x [B, K, D]``, all tokens (``num_prefix``: the
    prefix and the register), and :meth:`full`, a block's output with the removed tokens held at
    their frozen features — what a full-length read sees (a Hugging Face layer returns it to
    transformers' hooks). ``mix``: ``(live [B, n] (ST), frozen [B, n, D])``, or None (Last-Layer
    Fusion: the output as it is). Every token is current (``positions`` the identity): a RoPE layer
    gets every row."""

    reduced = True  # the full-length view is not the layer's own output

    def __init__(self, x: torch.Tensor, num_prefix: int, mix):
        self.x, self.num_prefix, self._mix = x, num_prefix, mix
        self.positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)

    def full(self, out: torch.Tensor) -> torch.Tensor:
        if self._mix is None:
            return out
        live, frozen = self._mix
        a = live[..., None]
        q = self.num_prefix
        return torch.cat([out[:, :q], a * out[:, q:] + (1 - a) * frozen], dim=1)
