"""ToMe as its authors run it (Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023).

In every block of ``block_range`` (default: all blocks), between attention and MLP, ``r`` tokens
merge by bipartite soft matching:

1. the current tokens alternate between sets A and B by their position in the sequence (even
   positions A, odd B, as ToMe splits the whole sequence); prefix tokens (CLS, registers) are in
   neither set: never merged away, never merged into;
2. the similarity of two tokens is the cosine of their keys averaged over heads (the keys the
   block's attention used, after any ``k_norm``);
3. each A token finds its most similar B token; the ``r`` A tokens with the highest similarity
   merge into their B match (several may share one);
4. merged features are size-weighted averages and sizes add up; the tokens continue as
   ``[prefix, unmerged A (in order), B]``, ToMe's concatenation of the two sets, which decides the
   next block's split (without a class token ToMe leaves unmerged A in similarity order; here they
   always keep their order); on a RoPE backbone a merged token keeps its destination's rotary
   position (:attr:`MergedTokens.positions`).

From the first merge on every block adds ``log(size)`` to its attention logits (proportional
attention, ``prop_attn``), inside the range and after it. ``r`` is clipped to the size of A, so at
least the prefix tokens and the B tokens (at least one) remain. Merged tokens are given back to
every source position wherever full-length features are read (:meth:`MergedTokens.full`), so
dense readers see each original token with the features of the token it was merged into, and an
average-pooling head weights a merged token by its size.
"""

from __future__ import annotations

from typing import Optional

import torch

from pullback_ext.prune.merged_tokens import MergedTokens
from pullback_ext.prune.methods.base import Needs
from pullback_ext.prune.methods.merging import (Matching, MergeStep, MergingMethod, ToMeOptions, alternating_order,
                                                apply_matching, best_match, bipartite_count, fused_merge,
                                                key_metric, matching_from_scores)


def bipartite_matching(keys: torch.Tensor, num_prefix: int, r: int) -> Optional[Matching]:
    """ToMe's matching of ``r`` merges (clipped, :func:`~pullback_ext.prune.methods.merging.bipartite_count`)
    on the tokens whose keys are ``keys [B, H, K, hd]``: the order ``[prefix, A, B]``, each A
    token's most similar B token, the ``r`` most similar pairs. None when nothing merges."""
    b, _, k, _ = keys.shape
    count = bipartite_count(r, num_prefix, k - num_prefix)
    if count == 0:
        return None
    order, size_a = alternating_order(num_prefix, k, b, keys.device)
    best, match = best_match(key_metric(keys), order, num_prefix, size_a)
    return matching_from_scores(order, num_prefix, size_a, best, match, count)


def bipartite_merge(state: MergedTokens, keys: torch.Tensor, r: int) -> MergedTokens:
    """One ToMe merge of ``r`` tokens of ``state.x [B, K, D]`` matched on ``keys [B, H, K, hd]``;
    returns the state with ``K - r`` tokens ``[prefix, A, B]`` (unchanged when nothing merges)."""
    matching = bipartite_matching(keys, state.num_prefix, r)
    return state if matching is None else apply_matching(state, matching)


class ToMe(MergingMethod):
    name, short, title = "tome", "ToMe", "ToMe (r tokens merged in every block)"
    options_type = ToMeOptions
    needs = Needs(split_blocks="ToMe merges between attention and MLP")
    rules = ("ToMe bipartite matching on head-mean keys, r per block (authors' rule)", "size-weighted, proportional attention")

    def rank(self, step: MergeStep) -> Optional[Matching]:
        return bipartite_matching(step.attended.k, step.state.num_prefix, step.r)

    def merge(self, step: MergeStep) -> MergedTokens:
        fused = fused_merge(step, "tome")
        return super().merge(step) if fused is None else fused[0]


ORDER = 1
METHODS = (ToMe(),)
