"""Deliberately broken variants shared by the tests of the per-block merging methods (ToMe,
PiToMe): each ``fn(monkeypatch)`` breaks one rule, and a reference test must then fail."""

from __future__ import annotations

import torch

from pullback_ext import ops
from pullback_ext.prune.methods import merging
from pullback_ext.prune.merged_tokens import MergedTokens


def merges_everywhere(monkeypatch):
    """Merge in every block, ignoring ``block_range`` and the schedule."""
    monkeypatch.setattr(merging, "block_merges", lambda options, depth: [options.r] * depth)


def unweighted_averages(monkeypatch):
    """Plain means instead of size-weighted ones (sizes still add up)."""
    merge = ops.merge_tokens

    def unweighted(x, w, src, dst, **kwargs):
        return merge(x, torch.ones_like(w), src, dst)[0], merge(x, w, src, dst)[1]

    monkeypatch.setattr(ops, "merge_tokens", unweighted)


def no_proportional_attention(monkeypatch):
    """No ``log(size)`` on the attention logits."""
    monkeypatch.setattr(MergedTokens, "size_bias", lambda self: None)
