"""Rotary position embeddings (RoPE) of a token-reduced sequence, shared by the RoPE backbones
(Hugging Face DINOv3, timm Eva / EVA-02).

A RoPE block is given one table row per patch token (prefix tokens — CLS, registers — are not
rotated). Once tokens are reduced, each current token keeps the row of its own original position:
:attr:`TokenState.positions <pullback_ext.prune.tokens.TokenState>` holds it (a merged token is
its destination, which keeps its place; a pruned token re-inserted by LLF is back at its own
position). :class:`RotaryRows` gathers those rows once per token state. The per-block originals'
token state (:class:`~pullback_ext.prune.merged_tokens.MergedTokens`) tracks the same positions
through ToMe's and PiToMe's reordering (a merged token at its destination's); EViT's fused token,
appended after the patch tokens and a sum over many positions, is given the row of no rotation
(``still``: cosine 1, sine 0), so that it is not rotated, like the prefix tokens.

:class:`DeferredAttention` serves the strategies that read attention (``evit_score``, ``asap_score``):
the block loop asks for a block's attention before it runs the block and passes only the tokens,
so the rows are not known yet; the block's runner, which knows them, fills the requested tensor
when it runs the block, before any stage reads it.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional

import torch


def select_rows(table: torch.Tensor, patch_index: torch.Tensor) -> torch.Tensor:
    """The rows of ``table [..., n, d]`` (``n`` patch tokens; leading axes, e.g. heads, broadcast)
    at ``patch_index [B, k]``, as ``[B, 1, k, d]`` (2-D table) or ``[B, ..., k, d]``: shaped to
    broadcast against queries and keys ``[B, H, k, d]``."""
    rows = table[..., patch_index, :]  # [..., B, k, d]
    lead = table.dim() - 2
    return rows.movedim(lead, 0) if lead else rows.unsqueeze(1)


def still_cos_sin(rows: tuple) -> tuple:
    """The row of no rotation ``[..., 1, d]`` of each of the ``(cos, sin)`` rows ``[..., k, d]``
    (Hugging Face DINOv3): cosine 1, sine 0."""
    cos, sin = rows
    return torch.ones_like(cos[..., :1, :]), torch.zeros_like(sin[..., :1, :])


def still_sin_cos_cat(rows: tuple) -> tuple:
    """The row of no rotation ``[..., 1, d]`` of timm's concatenated ``[sin, cos]`` rows ``[..., k, d]``
    (``apply_rot_embed_cat``): sine 0, cosine 1."""
    (table,) = rows
    sin, cos = table[..., :1, :].chunk(2, dim=-1)
    return (torch.cat([torch.zeros_like(sin), torch.ones_like(cos)], dim=-1),)


class RotaryRows:
    """The table rows of the current tokens of a token state, gathered once per state and table.

    ``select(state, tables, key)``: ``tables`` (a tuple of ``[..., n, d]`` tables, e.g. ``(cos,
    sin)``) unchanged while nothing was reduced (so an unreduced run is bit-identical), else their
    rows at the current patch tokens' positions, then for each extra token of the state (EViT's
    fused token) the row of no rotation, ``still(rows)`` (:func:`still_cos_sin`,
    :func:`still_sin_cos_cat`); ``key`` names the tables (one per block when each block has its
    own). A new object per forward: it holds the last state it saw.
    """

    def __init__(self, num_prefix: int, still: Optional[Callable] = None):
        self.num_prefix = num_prefix
        self.still = still
        self._state = None
        self._rows: dict = {}

    def select(self, state, tables: tuple, key: Hashable = 0) -> tuple:
        if state is None or not state.reduced:
            return tables
        if state is not self._state:
            self._state, self._rows = state, {}
        if key not in self._rows:
            index = state.positions[:, self.num_prefix:] - self.num_prefix
            rows = tuple(select_rows(table, index) for table in tables)
            extra = getattr(state, "num_extra", 0)
            if extra:
                rows = tuple(torch.cat([r, s.expand(*r.shape[:-2], extra, r.shape[-1])], dim=-2)
                             for r, s in zip(rows, self.still(rows)))
            self._rows[key] = rows
        return self._rows[key]


class DeferredAttention:
    """Head-averaged attention ``[B, K, K]`` of RoPE blocks, computed when the block runs.

    :meth:`request` is the ``attention_probs(block, x, bias)`` of the block loop: it returns an
    empty tensor and remembers the block; the block's runner calls :meth:`fill` with the block, its
    input, bias and rotary rows just before running it, which computes ``probs(block, x, bias,
    rows)`` into that tensor (the strategies read it only at the next stage, after the block ran).
    """

    def __init__(self, probs: Callable):
        self.probs = probs
        self._pending: Optional[tuple] = None

    def request(self, block, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = x.new_empty(x.shape[0], x.shape[1], x.shape[1])
        self._pending = (block, out)
        return out

    def fill(self, block, x: torch.Tensor, bias: Optional[torch.Tensor], rows) -> None:
        """Compute the attention :meth:`request` returned for ``block`` (nothing if none is pending)."""
        if self._pending is None or self._pending[0] is not block:
            return
        out = self._pending[1]
        self._pending = None
        out.copy_(self.probs(block, x, bias, rows))
