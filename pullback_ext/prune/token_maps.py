"""Where every original token is after a block, as the method's own block loop tracks it.

The *holder map* of a token state is ``[B, N]`` (int64) over the ``N`` original tokens of the
sequence the loop runs on (prefix tokens first): the index, among the current tokens, of the token
that holds each original token — tokens merged together share the index of the token they became
(:meth:`MergedTokens.holders <pullback_ext.prune.merged_tokens.MergedTokens.holders>`,
:meth:`TokenState.holders <pullback_ext.prune.tokens.TokenState.holders>`) — and :data:`PRUNED`
(-1) for a token out of the sequence (pruned, its frozen features kept for re-insertion). It is the
map the loop restores full-length features with, read without features.

Every method's block loop calls :func:`report` after each block with a function giving that map;
a reader opens a :func:`recording` around a forward to collect the maps of the blocks it names::

    with token_maps.recording(blocks=(2, 5)) as recorded:
        model(images)
    recorded.maps[2][0]  # [B, N] holder map after block 2 of the first forward that ran it

With no recording open, :func:`report` returns at once (one look at an empty list, which
``torch.compile`` traces as a constant): a forward computes no map it was not asked for.
Recordings are per process, not per thread: open one around one forward at a time.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

PRUNED = -1  # the holder of a token out of the sequence
_OPEN: list = []  # the recordings open now, innermost last


@dataclass
class Recording:
    """The holder maps of ``blocks`` (0-based) reported while the recording was open: ``maps[i]``
    holds one ``[B, N]`` map per forward that ran block ``i`` (detached, on the forward's device)."""

    blocks: frozenset
    maps: dict = field(default_factory=dict)


@contextlib.contextmanager
def recording(blocks: Iterable[int]) -> Iterator[Recording]:
    """Collect the holder maps of ``blocks`` reported by the forwards run inside the block."""
    recorded = Recording(frozenset(int(b) for b in blocks))
    _OPEN.append(recorded)
    try:
        yield recorded
    finally:
        _OPEN.remove(recorded)


def report(block: int, holders: Callable[[], torch.Tensor]) -> None:
    """After block ``block`` of a method's loop: ``holders()`` (the ``[B, N]`` holder map of the
    state after that block) goes to every open recording that asks for the block; it is called
    only then."""
    if not _OPEN:
        return
    wanted = [recorded for recorded in _OPEN if block in recorded.blocks]
    if wanted:
        held = holders().detach()
        for recorded in wanted:
            recorded.maps.setdefault(block, []).append(held)
