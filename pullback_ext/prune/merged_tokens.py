"""Token state of the methods that reduce inside every block (ToMe, EViT, …): the current tokens and
where every original token went, so that full-length features can be read at any block.

Unlike :class:`~pullback_ext.prune.tokens.TokenState` (the single-stage pipeline, which keeps the
current tokens in their original order) the current tokens may be reordered at each reduction —
ToMe concatenates its two sets, EViT appends its fused token — so the maps kept are ``owner
[B, N]``, the current index holding each original token (ToMe's "source" tracking), and
``positions``, the original place of each current token, which the RoPE backbones rotate it by
(:class:`~pullback_ext.prune.rope.RotaryRows`): a merged token keeps its destination's place, a
kept token its own; EViT's fused token, a sum over many places, has none (the RoPE backbones do not
rotate it, as they do not rotate the prefix tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch

from pullback_ext import ops
from pullback_ext.prune.token_maps import report


@dataclass
class MergedTokens:
    """Current tokens ``x [B, K, D]``: ``num_prefix`` prefix tokens (CLS, registers), the current patch
    tokens, then ``num_extra`` tokens that are not patch tokens (EViT's fused token).

    ``owner [B, N]`` (int64, None while nothing was reduced): index in ``x`` of the token that holds
    original token ``n``. ``sizes [B, K]`` (x's dtype, None while nothing was merged or when the
    method does not track them): how many original tokens each current token stands for.
    ``positions [B, num_prefix + num_patch]`` (int64, None while nothing was reduced): the original
    index of each prefix and patch token (the extra tokens have none).
    """

    x: torch.Tensor
    num_prefix: int
    owner: Optional[torch.Tensor] = None
    sizes: Optional[torch.Tensor] = None
    num_extra: int = 0
    positions: Optional[torch.Tensor] = None

    @property
    def reduced(self) -> bool:
        """Whether any token was merged, fused or reordered so far."""
        return self.owner is not None

    @property
    def num_patch(self) -> int:
        """Number of current patch tokens (neither prefix nor extra)."""
        return self.x.shape[1] - self.num_prefix - self.num_extra

    def with_x(self, x: torch.Tensor) -> "MergedTokens":
        """The same bookkeeping with new features ``x [B, K, D]`` for the same tokens."""
        return replace(self, x=x)

    def regroup(self, x: torch.Tensor, new_index: torch.Tensor, places: torch.Tensor,
                sizes: Optional[torch.Tensor] = None, num_extra: int = 0) -> "MergedTokens":
        """The state after a reduction: ``x [B, K', D]`` the new tokens, ``new_index [B, K]`` the
        index in ``x`` of the token each *current* token went into, ``places [B, K' - num_extra]``
        the current token whose place each new prefix or patch token takes (a merged token: its
        destination); ``sizes [B, K']`` if tracked."""
        owner = new_index if self.owner is None else torch.gather(new_index, 1, self.owner)
        positions = places if self.positions is None else torch.gather(self.positions, 1, places)
        return MergedTokens(x=x, num_prefix=self.num_prefix, owner=owner, sizes=sizes, num_extra=num_extra,
                            positions=positions)

    def full(self, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Full-length ``[B, N, D]`` from ``x`` (default: the current tokens): every original token
        takes the features of the token that holds it ("unmerging")."""
        x = self.x if x is None else x
        if self.owner is None:
            return x
        # owner is built from topk/argsort: valid by construction
        return ops.gather_tokens(x, self.owner, check_values=False)

    def holders(self) -> torch.Tensor:
        """``[B, N]`` (int64): the index in ``x`` of the token that holds each original token (the
        map :meth:`full` restores by; :mod:`pullback_ext.prune.token_maps`)."""
        if self.owner is not None:
            return self.owner
        b, k = self.x.shape[:2]
        return torch.arange(k, device=self.x.device).expand(b, k)

    def size_bias(self) -> Optional[torch.Tensor]:
        """Proportional attention ``log(size)`` as an additive mask ``[B, 1, 1, K]``, or None before
        the first merge (then the blocks run exactly as unpatched)."""
        return None if self.sizes is None else self.sizes.log()[:, None, None, :]


def run_tracked(state: MergedTokens, blocks: Sequence, step: Callable, take=()):
    """Run ``step(i, block, state) -> state`` for every block, reporting each state's holder map
    (:func:`~pullback_ext.prune.token_maps.report`); returns ``(final [B, N, D], {i: full-length
    features after block i for i in take})``. ``state``: anything with ``full()`` and ``holders()``
    (a :class:`MergedTokens` or a :class:`~pullback_ext.prune.tokens.TokenState`)."""
    taken = {}
    for i, block in enumerate(blocks):
        state = step(i, block, state)
        report(i, state.holders)
        if i in take:
            taken[i] = state.full()
    return state.full(), taken
