"""TAP deployed: the block loop that physically removes tokens (what ``strategy="tap"`` runs).

The register is inserted after the prefix tokens at the input of block 0, so the sequence entering
block 0 is one token longer than the unpatched model's. At each eligible layer the register's
read-out scores the current patch tokens and gives the shares of the budget still to remove
(their mean over the batch: every image of a batch removes the same number of tokens at each layer,
so the sequence stays rectangular; the counts are read on the host); the lowest-scoring tokens go.
After the last eligible layer exactly ``floor(ρ·N + 0.5)`` patch tokens remain for every image.

Dense tasks (``depth``): a removed token's frozen feature is its recovered feature at the layer that
removes it, ``α·x_t + (1 − α)·m_t`` (:func:`pullback_ext.prune.recovery.recover`, α from the
read-out), re-inserted wherever features are read; the last block runs on the full sequence
(masked Last-Layer Fusion). The CLS task never reads removed tokens: no recovery, no LLF.
Outputs are full-length ``[B, N, D]`` without the register.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.grids import grid_shape
from pullback_ext.prune.recovery import recover_pruned
from pullback_ext.prune.strategies import lowest
from pullback_ext.prune.tokens import TokenState
from pullback_ext.tap.budget import BudgetPlan
from pullback_ext.tap.register import TaskRegister, check_adapters
from pullback_ext.tap.tokens import batch_shares, strip_register


def check_fits(register: TaskRegister, depth: int) -> None:
    """The register's eligible layers must fit a ``depth``-block model (dense: before the LLF block)."""
    last = depth - 1 if register.task == "depth" else depth
    if register.layers[1] > last:
        raise PullbackError(f"the task register's eligible layers {register.layers} do not fit this {depth}-block model "
                            f"(a {register.task} register's stop must be <= {last})")


def check_model(register: TaskRegister, blocks: Sequence, width: int) -> None:
    """At patch time: the register must fit the model's depth (:func:`check_fits`) and token
    ``width``, and a TAP-J register's adapters the linears of ``blocks``."""
    check_fits(register, len(blocks))
    if register.dim != int(width):
        raise PullbackError(f"the task register is {register.dim}-wide but this model's tokens are {int(width)}-wide: "
                            f"a register serves the model it was trained on")
    check_adapters(register, blocks)


def run(reduction, x: torch.Tensor, blocks: Sequence, call_block: Callable, take=()):
    """Run ``blocks`` on ``x [B, N, D]`` with TAP (``reduction``: resolved options with
    ``strategy="tap"``, its strategy holding the :class:`TaskRegister`, ``ratio`` = 1 − ρ).
    Returns ``(final [B, N, D], {i: features after block i [B, N, D] for i in take})``. A strategy
    with a ``share_mean`` runs the training forward (:func:`pullback_ext.tap.relaxed.run_relaxed`)."""
    register: TaskRegister = reduction.strategy.register
    p, depth = reduction.backbone.num_prefix, reduction.backbone.depth
    if reduction.strategy.share_mean is not None:
        from pullback_ext.tap.relaxed import run_relaxed

        return run_relaxed(register, x, blocks, call_block, p, 1.0 - reduction.options.ratio, take, reduction.strategy.share_mean)
    check_fits(register, depth)
    rho = 1.0 - reduction.options.ratio
    grid = grid_shape(x.shape[1] - p)
    plan = BudgetPlan(x.shape[1] - p, rho, register.num_layers)
    call = register.block_caller(call_block)
    state = TokenState.start(register.insert(x, p), p + 1)
    taken = {}
    for i, block in enumerate(blocks):
        stage = register.stage(i)
        if stage is not None:
            read = register.read(stage, state.x[:, p], state.x[:, p + 1:], rho)
            count = plan.take(stage, batch_shares(read.shares))
            if count:
                state = state.prune(lowest(read.scores, count, p + 1))
                if read.alpha is not None:
                    state = recover_pruned(state, grid, read.alpha[:, None, None].to(state.x.dtype), newest=count)
        if register.task == "depth" and i == depth - 1 and state.reduced:
            state = state.restore(masked=True)
        bias = state.attention_bias(proportional=False)
        state.x = call(i, block, state, bias)
        if i in take:
            taken[i] = strip_register(state.full(), p)
    return strip_register(state.full(), p), taken
