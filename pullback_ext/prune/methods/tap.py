"""TAP deployed: the block loop that physically removes tokens (what ``strategy="tap"`` runs).

The register is inserted after the prefix tokens at the input of block 0, so the sequence entering
block 0 is one token longer than the unpatched model's. At each eligible layer the register's
read-out scores the current patch tokens and gives the shares of the budget still to remove
(their mean over the batch: every image of a batch removes the same number of tokens at each layer,
so the sequence stays rectangular; the counts are read on the host, and the method is
``batch_dependent``: a matched-cost comparison measures it one image at a time); the lowest-scoring
tokens go.
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
from pullback_ext.prune.methods.base import BackboneShape, BlockLoop, Method, Needs
from pullback_ext.prune.recovery import recover_pruned
from pullback_ext.prune.strategies import lowest
from pullback_ext.prune.token_maps import report
from pullback_ext.prune.tokens import TokenState
from pullback_ext.tap.budget import BudgetPlan, keep_count, tokens_per_block
from pullback_ext.tap.checkpoint import as_register
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
    ``strategy="tap"``, its ``strategy`` the :class:`TaskRegister`, ``ratio`` = 1 − ρ).
    Returns ``(final [B, N, D], {i: features after block i [B, N, D] for i in take})``."""
    register: TaskRegister = reduction.strategy
    p, depth = reduction.backbone.num_prefix, reduction.backbone.depth
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
        report(i, state.holders)
        if i in take:
            taken[i] = strip_register(state.full(), p)
    return strip_register(state.full(), p), taken


def tap_rules(register) -> tuple[str, str, str]:
    """``(method, selection, averaging)`` of TAP with the trained ``register``: TAP-F, or TAP-J
    with its LoRA rank."""
    start, stop = register.layers
    method = f"TAP-J (LoRA rank {register.lora_rank})" if register.adapted else "TAP-F"
    selection = (f"lowest task-register score; exact budget, split over block inputs {start}–{stop - 1} "
                 "by the register's read-out (per batch)")
    averaging = "pruned, re-inserted as α·frozen + (1 − α)·kept-neighbour mean, masked LLF" if register.task == "depth" \
        else "pruned, removed tokens dropped"
    return method, selection, averaging


def tap_row(register, name: str, unpruned: bool = False) -> str:
    """The row label of the TAP checkpoint ``name``; ``unpruned``: its one-point row at ρ = 1, whose
    error is the register's (and TAP-J's adapted backbone's) alone."""
    method, selection, averaging = tap_rules(register)
    if unpruned:
        alone = "the adapted backbone and the register" if register.adapted else "the register token"
        return f"{method} [{name}] · nothing removed (ρ = 1) · {alone} against the frozen unpruned model"
    return f"{method} [{name}] · {selection} · {averaging}"


class TAP(Method):
    """TAP deployed: ``head=`` a trained register (or its checkpoint folder), ``ratio`` = η = 1 − ρ."""

    name, short, title = "tap", "TAP", "TAP (a trained task register ranks tokens and splits an exact budget over depth)"
    takes = ("ratio", "head")
    needs = Needs(extra_token="adds a task-register token, which this model's rotary rows do not count")
    batch_dependent = True  # the budget's split over depth is the batch's mean share

    def checked_head(self, head, layers: tuple):
        return as_register(head)

    def sweep_grid(self, mode: str, ratios: tuple) -> dict:
        raise PullbackError("--methods: TAP rows come from trained registers; give their folders with --tap DIR[,DIR]")

    def check(self, fields: dict, changed: set) -> None:
        refused = sorted(changed - set(self.takes) - {"mode", "prop_attn"})
        if refused or fields["mode"] not in ("auto", "prune"):
            raise PullbackError(f"strategy 'tap' does not take {refused[0] if refused else 'mode'}; it takes head= (a TAP checkpoint "
                                f"folder or TaskRegister) and ratio= (the fraction of patch tokens removed)")
        if not isinstance(fields["ratio"], float):
            raise PullbackError(f"strategy 'tap' takes one float ratio (its register splits it over depth); got {fields['ratio']}")

    def resolve(self, options, backbone: BackboneShape) -> dict:
        check_fits(options.head, backbone.depth)
        return {"mode": "prune", "prop_attn": False}

    def build(self, options):
        return options.head

    def check_blocks(self, reduction, blocks: Sequence, width: int) -> None:
        check_model(reduction.strategy, blocks, width)

    def run(self, reduction, x: torch.Tensor, loop: BlockLoop, take=()):
        return run(reduction, x, loop.blocks, loop.call_block, take)

    def patch_tokens_per_block(self, reduction, num_patch: int) -> list:
        """The exact counts before its first and from its last eligible layer on, None between them,
        where the split is per batch (:func:`pullback_ext.tap.budget.tokens_per_block`)."""
        register = reduction.strategy
        return tokens_per_block(register.layers, register.task, 1.0 - reduction.options.ratio, num_patch, reduction.backbone.depth)

    def eta(self, reduction, num_patch: int) -> float:
        """Exactly ``floor(ρN + 0.5)`` patch tokens remain after its last reduction."""
        return 1.0 - keep_count(1.0 - reduction.options.ratio, num_patch) / num_patch

    def describe(self, reduction) -> dict:
        method, selection, averaging = tap_rules(reduction.strategy)
        return {"method": method, "selection": selection, "averaging": averaging}


ORDER = 6
METHODS = (TAP(),)
