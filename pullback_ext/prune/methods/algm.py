"""ALGM as its authors run it (Norouzi, Orlova, de Geus, Dubbelman, "ALGM: Adaptive
Local-then-Global Token Merging for Efficient Semantic Segmentation with Plain Vision
Transformers", CVPR 2024), from their code, ``tue-mps/algm-segmenter@674eaa2`` (commit
674eaa290118e290dd7ddf620bed2f98eee771d5; ``local_merge.py``, ``global_merge.py`` and
``algm_segmenter_patch.py`` below are ``algm/algm/local_merge.py``, ``algm/algm/global_merge.py``
and ``algm/algm/patch/algm_segmenter_patch.py``; lines cited below).

ALGM merges in the blocks of ``algm_layers`` only (default: the 0-based blocks 0 and 4 of a
12-block ViT, the authors' 1-based ``--selected-layers 1 5`` for ViT-Ti/S/B, README.md:64, :72,
TRAINING.md:26, :39, :51; 0 and 6 of a 24-block ViT-L, ``--selected-layers 1 7``, TRAINING.md:63;
other depths: 0 and block 4 of 12 scaled), between attention and MLP
(``algm_segmenter_patch.py:33-67``; the blocks are numbered from 1, ``:151-163``). The similarity is
the cosine of the tokens themselves, the block's input plus its attention output (``x`` at
``algm_segmenter_patch.py:34, 39-43, 53-59``; the queries the patched attention returns are unused):

1. **local pooling** in the first of them (``algm_segmenter_patch.py:37``, ``local_merge.py:13-117``):
   the patch grid (square, ``local_merge.py:29-31``) is cut into ``local_window`` windows
   (default 2 × 2, ``algm_segmenter_patch.py:130``, the only size the authors' commands give,
   README.md:73); a window's similarity is the mean cosine over the ordered pairs of distinct
   tokens in it (``local_merge.py:43-54``); every image pools the same number of windows, the
   *smallest* count over the batch of windows whose similarity is ``>= local_threshold``
   (``local_merge.py:60-63``), each image its own most similar ones (``:67``). A pooled window
   becomes one token, the mean of its tokens, in the place of its last (bottom-right) token
   (``local_merge.py:98-100, 104-115``, ``merge_wavg`` ``:119-130``); the tokens continue as
   ``[prefix, pooled windows (most similar first), the other tokens in their order]``
   (``local_merge.py:97, 113-114``). Default threshold 0.88 (``algm_segmenter_patch.py:131``,
   ``segm/train.py:54``, ``segm/eval/miou.py:203``; per backbone the authors train with 0.9
   for ViT-Ti, 0.88 for ViT-S, 0.94 for ViT-B, 0.95 for ViT-L, TRAINING.md:27, :41, :52, :64);
2. **global merging** in each later one (``algm_segmenter_patch.py:51-64``,
   ``global_merge.py:10-77``): ToMe's bipartite matching on the tokens (sets A and B alternate by
   position, prefix tokens in neither, each A token's most similar B token, ``global_merge.py:34-45``),
   where the number of merges is adaptive (``global_merge.py:47-52``): with ``s_j`` the best
   similarity of A token ``j``, the threshold is ``mean_b(mean_j s) + mean_b(std_j s) / l`` (the
   means over the images of the batch; ``std`` the sample standard deviation; ``l`` the block's
   1-based number, 5 for block 4) and every image merges the smallest count over the batch of A
   tokens whose ``s_j`` reaches it, its own most similar pairs (``global_merge.py:56-58``); the
   tokens continue as ``[prefix, unmerged A (in order), B]`` (``global_merge.py:60-62, 75``).

Merged features are size-weighted means and sizes add up (``merge_wavg``, ``local_merge.py:119-130``,
``algm_segmenter_patch.py:48, 64``), so a global merge weighs a pooled window by its four
tokens. No proportional attention: the patch sets ``prop_attn=True`` and hands the sizes to its
attention (``algm_segmenter_patch.py:32-33, 122``), whose forward never uses them (``:74-102``),
and the other blocks are plain (``segm/model/blocks.py:89-95``); ``prop_attn`` therefore defaults
to off here (``True`` adds ``log(size)`` as ToMe does). Every original token is given back the
features of the token that holds it wherever full-length features are read
(:meth:`~pullback_ext.prune.merged_tokens.MergedTokens.full`): a dense decoder reads full-length
features. ``local_threshold`` above 1 pools nothing (a mean cosine is at most 1); with
``algm_layers`` of that one block nothing is reduced and the model runs as unpatched.

The authors fine-tune Segmenter with ALGM in place (``segm/train.py:212-215``, the commands of
TRAINING.md) and evaluate the fine-tuned model with the same settings (``segm/eval/miou.py:235-238``);
this runs it on a frozen backbone.

Where the paper and the code differ, or the code does not carry over: the paper's abstract puts
the global merging "halfway through the network", the code at block 5 of 12 (7 of 24); the
Segmenter decoders run on the merged tokens and unmerge their masks by the source map
(``segm/model/decoder.py:28-47, 121-134``), here the features are unmerged before any reader (the
same for a per-token linear head, not for the mask transformer's attention). The code takes the
first token as the class token unconditionally (``local_merge.py:27``, ``:107``) and, without one,
leaves the first A token out of the statistics (``global_merge.py:50``); here every prefix token
(CLS, registers, none) is left out of both steps and the unmerged A tokens always keep their
order. Ties go by position (the authors' ``topk`` and ``argsort`` are not stable); a global step with
fewer than two A tokens (no standard deviation) or no B token merges nothing. The counts depend on
the images (and, through the minimum and the batch means, on the whole batch): they are read on
the host at the two merging blocks, and η is not known before a forward pass
(:meth:`ALGM.patch_tokens_per_block` gives None from the first merging block on). The method is
therefore ``batch_dependent``: a matched-cost comparison measures its errors, FLOPs and times one
image at a time (:mod:`pullback_ext.comparison.pareto`), the reduction each image gets alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune.matching import working_precision
from pullback_ext.prune.methods.base import BackboneShape, BlockLoopMethod, Needs, Reduction
from pullback_ext.prune.methods.merging import (Matching, MergeStep, MergingMethod, alternating_order, best_match,
                                                matching_from_scores)
from pullback_ext.prune.option_checks import check_layer_range, is_int, is_real, layer_list
from pullback_ext.prune.schedules import scale_layers

AUTHORS_LAYERS = {12: (0, 4), 24: (0, 6)}  # 0-based: --selected-layers 1 5 (ViT-Ti/S/B), 1 7 (ViT-L)
REFERENCE_LAYERS = (0, 4)  # of 12 blocks, scaled to other depths
DEFAULT_THRESHOLD = 0.88
DEFAULT_WINDOW = (2, 2)


def default_layers(depth: int) -> tuple:
    """ALGM's blocks for a ``depth``-block model: the authors' for 12 and 24 blocks, else 0 and
    block 4 of 12 scaled (raises naming ``algm_layers`` where they do not scale).
    >>> default_layers(12), default_layers(24), default_layers(6)
    ((0, 4), (0, 6), (0, 2))
    """
    if depth in AUTHORS_LAYERS:
        return AUTHORS_LAYERS[depth]
    try:
        return scale_layers(REFERENCE_LAYERS, depth)
    except PullbackError as exc:
        raise PullbackError(f"algm_layers: ALGM's blocks 0 and 4 of 12 do not scale to this {depth}-block model "
                            f"({exc}); give algm_layers=") from None


def grid_side(num_patch: int, window: tuple) -> int:
    """The side of the square patch grid of ``num_patch`` tokens; raises unless it is square and
    the ``window (h, w)`` tiles it."""
    side = math.isqrt(num_patch)
    if side * side != num_patch:
        raise PullbackError(f"strategy 'algm' pools windows of a square patch grid; got {num_patch} patch tokens")
    if side % window[0] or side % window[1]:
        raise PullbackError(f"local_window {window} must tile the {side}×{side} patch grid (both sides dividing {side})")
    return side


def window_tokens(side: int, window: tuple, device) -> torch.Tensor:
    """``[G, h·w]``: the patch indices of each ``window (h, w)`` of the ``side × side`` grid, the
    windows and the tokens in each in row-major order."""
    wh, ww = window
    rows = torch.arange(side // wh, device=device)[:, None, None, None] * wh + torch.arange(wh, device=device)[:, None]
    cols = torch.arange(side // ww, device=device)[None, :, None, None] * ww + torch.arange(ww, device=device)
    return (rows * side + cols).reshape(-1, wh * ww)


def window_similarity(unit: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """``[B, G]``: the mean cosine over the ordered pairs of distinct tokens of each window
    (``unit [B, n, d]``: unit vectors of the patch tokens; ``windows [G, k]``)."""
    grouped = unit[:, windows]  # [B, G, k, d]
    k = windows.shape[1]
    cos = grouped @ grouped.transpose(-1, -2)
    eye = torch.eye(k, dtype=torch.bool, device=unit.device)
    return cos.masked_fill(eye, 0.0).sum(dim=(-1, -2)) / (k * (k - 1))


def shared_count(passed: torch.Tensor) -> int:
    """How many tokens or windows every image of the batch reduces: the smallest count over the
    batch of the ``passed [B, m]`` (bool) ones (read on the host)."""
    return int(passed.sum(dim=1).min())


def local_matching(x: torch.Tensor, num_prefix: int, window: tuple, threshold: float) -> Optional[Matching]:
    """ALGM's local pooling of ``x [B, K, D]`` as a :class:`Matching`: the order ``[prefix, pooled
    windows (each window's tokens, most similar window first), the other patch tokens]``, each
    window's tokens merging into its last one. None when no window pools."""
    b, k, _ = x.shape
    n, p = k - num_prefix, num_prefix
    windows = window_tokens(grid_side(n, window), window, x.device)
    with torch.no_grad():
        unit = torch.nn.functional.normalize(working_precision(x[:, p:]), dim=-1)
        similarity = window_similarity(unit, windows)
        count = shared_count(similarity >= threshold)
    if count == 0:
        return None
    size = windows.shape[1]
    chosen = torch.argsort(similarity, dim=1, descending=True, stable=True)[:, :count]
    members = windows[chosen].flatten(1)  # [B, count · size]
    pooled = torch.zeros(b, n, dtype=torch.int8, device=x.device).scatter(1, members, 1)
    rest = torch.argsort(pooled, dim=1, stable=True)[:, :n - members.shape[1]]
    order = torch.cat([torch.arange(p, device=x.device).expand(b, p), members + p, rest + p], dim=1)
    starts = p + size * torch.arange(count, device=x.device)
    src = (starts[:, None] + torch.arange(size - 1, device=x.device)).flatten()
    dst = (starts + size - 1).repeat_interleave(size - 1)
    return Matching(order, src.expand(b, -1), dst.expand(b, -1))


def adaptive_threshold(best: torch.Tensor, layer_number: int) -> torch.Tensor:
    """The global step's threshold from the best similarities ``best [B, |A|]``: the batch mean of
    their means plus the batch mean of their sample standard deviations over ``layer_number``."""
    return best.mean(dim=1).mean() + best.std(dim=1).mean() / layer_number


def global_matching(x: torch.Tensor, num_prefix: int, layer_number: int) -> Optional[Matching]:
    """ALGM's global merging of ``x [B, K, D]`` in the block numbered ``layer_number`` (1-based):
    ToMe's split and best matches on the tokens' cosine, the A tokens at or above
    :func:`adaptive_threshold` merged (their smallest count over the batch). None when none merges."""
    b, k, _ = x.shape
    order, size_a = alternating_order(num_prefix, k, b, x.device)
    if size_a < 2 or k - num_prefix - size_a < 1:
        return None
    with torch.no_grad():
        unit = torch.nn.functional.normalize(working_precision(x), dim=-1)
        best, match = best_match(unit, order, num_prefix, size_a)
        count = shared_count(best >= adaptive_threshold(best, layer_number))
    if count == 0:
        return None
    return matching_from_scores(order, num_prefix, size_a, best, match, count)


def checked_window(window) -> tuple[int, int]:
    values = (window, window) if is_int(window) else tuple(window) if isinstance(window, (list, tuple)) else ()
    if len(values) != 2 or not all(is_int(v) and v >= 1 for v in values) or values[0] * values[1] < 2:
        raise PullbackError(f"local_window must be (h, w) ints >= 1 with at least 2 tokens in a window, or one int "
                            f"(a square window); got {window!r}")
    return int(values[0]), int(values[1])


@dataclass(frozen=True)
class ALGMOptions:
    """``local_threshold``: the mean pairwise cosine a window must reach to be pooled (default
    0.88; above 1 none is); ``local_window``: the ``(h, w)`` windows of the local pooling (or one
    int, a square window; default 2 × 2); ``algm_layers``: the blocks that merge (0-based), the
    first pooling locally, each later one merging globally (None: 0 and 4 of 12 blocks, 0 and 6
    of 24, else scaled)."""

    local_threshold: float = DEFAULT_THRESHOLD
    local_window: int | tuple[int, int] = DEFAULT_WINDOW
    algm_layers: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        tau = self.local_threshold
        if not is_real(tau) or not -1.0 <= float(tau) < float("inf"):
            raise PullbackError(f"local_threshold must be a finite float >= -1 (the mean pairwise cosine a window must "
                                f"reach to be pooled; above 1 none is); got {tau!r}")
        object.__setattr__(self, "local_threshold", float(tau))
        object.__setattr__(self, "local_window", checked_window(self.local_window))
        if self.algm_layers is not None:
            object.__setattr__(self, "algm_layers", layer_list(self.algm_layers, "algm_layers"))


class ALGM(MergingMethod):
    """ALGM on ToMe's loop (:class:`MergingMethod`): its schedule (a merge request at the blocks of
    ``algm_layers``: :meth:`block_merges`), its rankings (the local pooling in the first of them,
    the adaptive global matching in the others) and :func:`apply_matching` for the rest (the
    size-weighted means, sizes, the maps that restore every original token and its rotary position)."""

    name, short, title = "algm", "ALGM", "ALGM (windows pooled at the first block, adaptive global merging later)"
    options_type = ALGMOptions
    needs = Needs(split_blocks="ALGM merges between attention and MLP")
    required = ()
    prop_attn_default = False  # the authors' attention never reads the sizes it is given
    rules = ("ALGM: windows of mean token cosine >= threshold pooled at one block, then bipartite merging of the token "
             "pairs above the adaptive threshold mean + std / l (authors' rule; run frozen here, its authors fine-tune "
             "Segmenter with it)",
             "size-weighted means; no proportional attention")
    sweep = {"local_threshold": (0.96, 0.94, 0.92, 0.9, 0.88, 0.85, 0.8, 0.75, 0.7)}
    batch_dependent = True  # every image reduces the batch's smallest counts

    def resolve(self, options, backbone: BackboneShape) -> dict:
        layers = default_layers(backbone.depth) if options.algm_layers is None else options.algm_layers
        check_layer_range(layers, backbone.depth, False, "algm_layers")
        if backbone.num_patch is not None:
            grid_side(backbone.num_patch, options.local_window)
        return dict(BlockLoopMethod.resolve(self, options, backbone), algm_layers=layers)  # no block_range

    def block_merges(self, reduction: Reduction) -> list[int]:
        """1 at the local block (0 when ``local_threshold`` > 1: it pools nothing and runs whole),
        2 at the global blocks, 0 elsewhere."""
        o = reduction.options
        local, rest = o.algm_layers[0], o.algm_layers[1:]
        merges = [2 if i in rest else 0 for i in range(reduction.backbone.depth)]
        merges[local] = int(o.local_threshold <= 1.0)
        return merges

    def rank(self, step: MergeStep) -> Optional[Matching]:
        o, state = step.reduction.options, step.state
        if step.block == o.algm_layers[0]:
            return local_matching(state.x, state.num_prefix, o.local_window, o.local_threshold)
        return global_matching(state.x, state.num_prefix, step.block + 1)

    def patch_tokens_per_block(self, reduction: Reduction, num_patch: int) -> list:
        """``num_patch`` before the first merging block, None from it on (the counts depend on the
        images); ``num_patch`` throughout when nothing merges."""
        merges = self.block_merges(reduction)
        first = next((i for i, m in enumerate(merges) if m), len(merges))
        return [num_patch if i < first else None for i in range(len(merges))]

    def eta(self, reduction: Reduction, num_patch: int) -> Optional[float]:
        """None (known only after a forward pass) unless nothing merges (0)."""
        last = self.patch_tokens_per_block(reduction, num_patch)[-1]
        return None if last is None else 0.0

    def describe(self, reduction: Reduction) -> dict:
        """The rules with the window, threshold and blocks in use."""
        o = reduction.options
        wh, ww = o.local_window
        rest = o.algm_layers[1:]
        blocks = f"block{'s' if len(rest) > 1 else ''} {', '.join(map(str, rest))}"
        merged = f"; at {blocks}, the bipartite pairs above the adaptive threshold mean + std / l merged" if rest else ""
        selection = (f"ALGM: {wh}×{ww} windows of mean token cosine >= {o.local_threshold:g} pooled at block "
                     f"{o.algm_layers[0]}{merged} (authors' rule; run frozen here, its authors fine-tune Segmenter with it)")
        averaging = "size-weighted means" + (
            ", proportional attention" if o.prop_attn else "; no proportional attention")
        return {"method": self.name, "selection": selection, "averaging": averaging}


ORDER = 10
METHODS = (ALGM(),)
