"""Token state of the methods that reduce inside every block (ToMe, EViT): the current tokens and
where every original token went, so that full-length features can be read at any block.

Unlike :class:`~pullback_ext.prune.tokens.TokenState` (the single-stage pipeline, which keeps the
current tokens in their original order) the current tokens may be reordered at each reduction —
ToMe concatenates its two sets, EViT appends its fused token — so the only map kept is
``owner [B, N]``, the current index holding each original token (ToMe's "source" tracking).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch

from pullback_ext import ops


@dataclass
class MergedTokens:
    """Current tokens ``x [B, K, D]``: ``num_prefix`` prefix tokens (CLS, registers), the current patch
    tokens, then ``num_extra`` tokens that are not patch tokens (EViT's fused token).

    ``owner [B, N]`` (int64, None while nothing was reduced): index in ``x`` of the token that holds
    original token ``n``. ``sizes [B, K]`` (x's dtype, None while nothing was merged or when the
    method does not track them): how many original tokens each current token stands for.
    """

    x: torch.Tensor
    num_prefix: int
    owner: Optional[torch.Tensor] = None
    sizes: Optional[torch.Tensor] = None
    num_extra: int = 0

    @property
    def num_patch(self) -> int:
        """Number of current patch tokens (neither prefix nor extra)."""
        return self.x.shape[1] - self.num_prefix - self.num_extra

    def with_x(self, x: torch.Tensor) -> "MergedTokens":
        """The same bookkeeping with new features ``x [B, K, D]`` for the same tokens."""
        return replace(self, x=x)

    def regroup(self, x: torch.Tensor, new_index: torch.Tensor, sizes: Optional[torch.Tensor] = None,
                num_extra: int = 0) -> "MergedTokens":
        """The state after a reduction: ``x [B, K', D]`` the new tokens, ``new_index [B, K]`` the
        index in ``x`` of the token each *current* token went into; ``sizes [B, K']`` if tracked."""
        owner = new_index if self.owner is None else torch.gather(new_index, 1, self.owner)
        return MergedTokens(x=x, num_prefix=self.num_prefix, owner=owner, sizes=sizes, num_extra=num_extra)

    def full(self, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Full-length ``[B, N, D]`` from ``x`` (default: the current tokens): every original token
        takes the features of the token that holds it ("unmerging")."""
        x = self.x if x is None else x
        if self.owner is None:
            return x
        # owner is built from topk/argsort: valid by construction
        return ops.gather_tokens(x, self.owner, check_values=False)

    def size_bias(self) -> Optional[torch.Tensor]:
        """Proportional attention ``log(size)`` as an additive mask ``[B, 1, 1, K]``, or None before
        the first merge (then the blocks run exactly as unpatched)."""
        return None if self.sizes is None else self.sizes.log()[:, None, None, :]


def run_tracked(state: MergedTokens, blocks: Sequence, step: Callable, take=()):
    """Run ``step(i, block, state) -> state`` for every block; returns ``(final [B, N, D],
    {i: full-length features after block i for i in take})``."""
    taken = {}
    for i, block in enumerate(blocks):
        state = step(i, block, state)
        if i in take:
            taken[i] = state.full()
    return state.full(), taken
