"""The block loop of every patched backbone: run the blocks with the reduction of a
:class:`~pullback_ext.prune.methods.base.Reduction` (``ReductionOptions.resolve``).

The family adapters (:mod:`pullback_ext.prune.timm_vit`, :mod:`pullback_ext.prune.hf_encoders`)
give their blocks and how to run them; the method of the reduction runs the loop
(:meth:`~pullback_ext.prune.methods.base.Method.run`). Outputs and intermediates are always
full-length ``[B, N, D]``, so decoders that read token grids work unchanged.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods.base import BlockLoop, Reduction
from pullback_ext.prune.split_block import SplitBlock


def run_blocks(
    reduction: Reduction,
    x: torch.Tensor,
    blocks: Sequence,
    call_block: Callable,
    attention_probs: Callable,
    take: Sequence[int] = (),
    split: Optional[SplitBlock] = None,
):
    """Run ``blocks`` on ``x [B, N, D]`` with the token reductions of ``reduction``.

    ``call_block(block, state, bias)`` runs one block on ``state.x`` and returns the new current
    tokens (``bias``: additive attention mask or None); ``attention_probs(block, x, bias)`` gives
    its head-averaged attention ``[B, K, K]``; ``split`` runs a block in two halves, which the
    methods that reduce between attention and MLP need.
    Returns ``(final [B, N, D], {i: features after block i [B, N, D] for i in take})``.
    """
    method = reduction.method
    if method.needs.split_blocks and split is None:
        raise PullbackError(f"strategy {method.name!r} reduces between attention and MLP, and this "
                            f"backbone's adapter cannot split its blocks (timm ViTs can: pullback_ext.patch.timm)")
    return method.run(reduction, x, BlockLoop(blocks, call_block, attention_probs, split), take)
