"""Token bookkeeping for a ViT whose sequence shrinks: pruning, merging, re-insertion.

A :class:`TokenState` follows one batch through the patched blocks. Its current tokens ``x``
(prefix tokens first, then the surviving patch tokens in their original order) are what the next
block sees; everything else needed to rebuild the full ``[B, N, D]`` sequence travels with it:

- prune mode: the frozen features of every pruned token and their original positions, re-inserted
  by the ``reinsert_tokens`` kernel wherever full-length features are needed (decoder hooks, LLF);
- merge mode: ``owner[b, n]``, the current token that original token ``n`` was merged into, so that
  "unmerging" is one ``gather_tokens`` call; ``sizes`` (original tokens per current token) feed
  proportional attention, ``weights`` the weighted averages of the ``merge_tokens`` kernel.

The token ops run with ``check_values=False`` on a TokenState's own index sets: those are built
from topk / argsort and valid by construction, and the checks would only add a device-to-host
synchronisation per op on CUDA (and a graph break under ``torch.compile``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from pullback_ext import ops
from pullback_ext.prune.folded_attention import FoldedSizes, StaleKeys
from pullback_ext.prune.token_maps import PRUNED


@dataclass
class TokenState:
    """Current tokens of a batch and what is needed to restore the full sequence.

    Shapes: ``x [B, K, D]``, ``positions [B, K]`` (original index of each current token, int64),
    ``sizes [B, K]`` and ``weights [B, K]`` (float, x's dtype), ``frozen [B, R, D]`` and
    ``frozen_positions [B, R]`` (pruned tokens), ``owner [B, N]`` (merge map, int64), ``stale [B, K]``
    (bool: re-inserted frozen tokens that the other tokens must not attend to; masked LLF).
    """

    x: torch.Tensor
    positions: torch.Tensor
    sizes: torch.Tensor
    weights: torch.Tensor
    num_prefix: int
    num_tokens: int
    frozen: Optional[torch.Tensor] = None
    frozen_positions: Optional[torch.Tensor] = None
    owner: Optional[torch.Tensor] = None
    stale: Optional[torch.Tensor] = None
    num_stale: int = 0

    @classmethod
    def start(cls, x: torch.Tensor, num_prefix: int) -> "TokenState":
        """Wrap the full sequence ``x [B, N, D]`` before any reduction."""
        b, n, _ = x.shape
        positions = torch.arange(n, device=x.device).expand(b, n)
        ones = torch.ones(b, n, dtype=x.dtype, device=x.device)
        return cls(x=x, positions=positions, sizes=ones, weights=ones, num_prefix=num_prefix, num_tokens=n)

    @property
    def num_patch(self) -> int:
        """Number of current non-prefix tokens."""
        return self.x.shape[1] - self.num_prefix

    @property
    def reduced(self) -> bool:
        """Whether any token was pruned or merged so far."""
        return self.x.shape[1] < self.num_tokens

    def prune(self, remove: torch.Tensor) -> "TokenState":
        """Drop the current tokens ``remove [B, R]`` (indices into ``x``, none a prefix token).

        Their features are frozen for later re-insertion; the kept tokens stay in order.
        """
        keep = _complement(remove, self.x.shape[1])
        remove = remove.sort(dim=1).values
        frozen = ops.gather_tokens(self.x, remove, check_values=False)
        kept = ops.gather_tokens(self.x, keep, check_values=False)
        frozen_positions = torch.gather(self.positions, 1, remove)
        if self.frozen is not None:
            frozen = torch.cat([self.frozen, frozen], dim=1)
            frozen_positions = torch.cat([self.frozen_positions, frozen_positions], dim=1)
        return replace(
            self,
            x=kept,
            positions=torch.gather(self.positions, 1, keep),
            sizes=torch.gather(self.sizes, 1, keep),
            weights=torch.gather(self.weights, 1, keep),
            frozen=frozen,
            frozen_positions=frozen_positions,
        )

    def merge(self, src: torch.Tensor, dst: torch.Tensor, weights: Optional[torch.Tensor] = None) -> "TokenState":
        """Merge current tokens ``src [B, R]`` into ``dst [B, R]`` (weighted averages, kernel).

        ``weights [B, K]`` replaces the tracked merge weights when given (e.g. importance scores
        at the first merge); sizes are always summed so that proportional attention stays exact.
        """
        k = self.x.shape[1]
        w = self.weights if weights is None else weights
        x, w_new = ops.merge_tokens(self.x, w, src, dst, check_values=False)
        _, sizes = ops.merge_tokens(self.sizes.unsqueeze(-1), self.sizes, src, dst, check_values=False)
        keep = _complement(src, k)
        # new index of every old token: its rank among the kept ones, or its destination's rank
        kept_mask = torch.ones(self.x.shape[0], k, dtype=torch.long, device=self.x.device).scatter(1, src, 0)
        rank = kept_mask.cumsum(1) - 1
        new_index = rank.scatter(1, src, torch.gather(rank, 1, dst))
        owner = new_index if self.owner is None else torch.gather(new_index, 1, self.owner)
        return replace(
            self,
            x=x,
            positions=torch.gather(self.positions, 1, keep),
            sizes=sizes,
            weights=w_new,
            owner=owner,
        )

    def full(self, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The full-length sequence ``[B, N, D]`` built from ``x`` (default: the current tokens).

        Pruned tokens come back with their frozen features at their original positions; merged
        tokens each take the feature of the token they were merged into.
        """
        x = self.x if x is None else x
        if self.owner is not None:
            return ops.gather_tokens(x, self.owner, check_values=False)
        if self.frozen is not None:
            return ops.reinsert_tokens(x, self.positions, self.frozen, self.frozen_positions, check_values=False)
        return x

    def holders(self) -> torch.Tensor:
        """``[B, N]`` (int64): the index in ``x`` of the current token that holds each original
        token (a merged token: the one it was merged into), ``PRUNED`` (-1) for a pruned one (the maps
        :meth:`full` restores by; :mod:`pullback_ext.prune.token_maps`)."""
        if self.owner is not None:
            return self.owner
        b, k = self.positions.shape
        held = torch.full((b, self.num_tokens), PRUNED, dtype=torch.long, device=self.x.device)
        return held.scatter(1, self.positions, torch.arange(k, device=self.x.device).expand(b, k))

    def restore(self, masked: bool = False) -> "TokenState":
        """Last-Layer Fusion: continue with the full sequence (pruned tokens re-inserted).

        ``masked``: mark the re-inserted tokens stale, so that :meth:`attention_bias` hides them
        from every token that was kept (those then compute exactly what they would without LLF).
        """
        state = TokenState.start(self.full(), self.num_prefix)
        if masked and self.frozen is not None:
            b, n, _ = state.x.shape
            state.stale = torch.zeros(b, n, dtype=torch.bool, device=state.x.device).scatter(1, self.frozen_positions, True)
            state.num_stale = self.frozen_positions.shape[1]
        return state

    def attention_bias(self, proportional: bool | str = True):
        """Additive attention mask for the current tokens, or None when there is nothing to add.

        Proportional attention (``proportional``, merge mode): ``log(size)``, ``[B, 1, 1, K]``, or with
        ``proportional="folded"`` a :class:`~pullback_ext.prune.folded_attention.FoldedSizes` for the
        block to fold into its attention. Masked LLF: ``-inf`` where a kept query meets a stale key,
        ``[B, 1, K, K]``, or with ``"folded"`` a :class:`~pullback_ext.prune.folded_attention.StaleKeys`
        for the block to run as two maskless attention calls.
        """
        if proportional == "folded" and self.owner is not None:
            return FoldedSizes(self.sizes.log())  # merge mode: no stale tokens
        if proportional == "folded" and self.stale is not None:
            return StaleKeys(torch.argsort(self.stale.to(torch.int8), dim=1, stable=True), self.x.shape[1] - self.num_stale)
        bias = self.sizes.log()[:, None, None, :] if (proportional and self.owner is not None) else None
        if self.stale is not None:
            hidden = ~self.stale[:, :, None] & self.stale[:, None, :]
            mask = torch.zeros(hidden.shape, dtype=self.x.dtype, device=self.x.device).masked_fill(hidden, float("-inf"))
            bias = mask[:, None] if bias is None else bias + mask[:, None]
        return bias


def _complement(remove: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[B, K-R]`` of 0..k-1 not in ``remove [B, R]``, in increasing order."""
    removed = torch.zeros(remove.shape[0], k, dtype=torch.int8, device=remove.device).scatter(1, remove, 1)
    order = torch.argsort(removed, dim=1, stable=True)
    return order[:, : k - remove.shape[1]]


def split_budget(num_patch: int, ratio, num_stages: int) -> list[int]:
    """Tokens to remove at each stage so that ``round(ratio * num_patch)`` go in total.

    ``ratio`` is a float (the total fraction, split evenly over the stages, earlier stages taking
    the remainder) or a sequence with one fraction of the original patch tokens per stage.
    """
    if isinstance(ratio, (int, float)):
        total = int(math.floor(float(ratio) * num_patch + 0.5))
        base, extra = divmod(total, num_stages)
        return [base + (1 if s < extra else 0) for s in range(num_stages)]
    return [int(math.floor(float(r) * num_patch + 0.5)) for r in ratio]
