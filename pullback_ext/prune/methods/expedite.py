"""Expedite as its authors describe it (Liang et al., "Expediting Large-Scale Vision Transformer for
Dense Prediction without Fine-tuning", NeurIPS 2022): a token clustering layer after an early
layer α shrinks the patch tokens to an ``h × w`` grid of cluster tokens, the blocks after it run on
those, and a token reconstruction layer rebuilds full-resolution tokens for the dense head.

Clustering (on the input of block ``cluster_layer`` = α, i.e. after α blocks; ``x [B, N, D]`` with
the patch tokens on a square ``S × S`` grid):

1. the initial centres are the adaptive average pooling of the patch grid to ``h × w``
   (``cluster_grid``);
2. each patch token considers only the ``λ × λ`` centres (``cluster_window``, odd) around the centre
   cell its grid position falls into (the cell of nearest-neighbour upsampling of the ``h × w`` grid
   to ``S × S``); ``κ`` times (``cluster_iters``) it is assigned softly,
   ``Q_ij = softmax_j(−‖x_i − s_j‖² / τ)`` over those centres (``cluster_tau`` = τ), and every centre
   becomes the ``Q``-weighted mean of the tokens, ``s_j = Σ_i Q_ij x_i / Σ_i Q_ij``;
3. the transformer continues on ``[prefix, s_1 .. s_hw]``; prefix tokens (CLS, registers) are kept
   as they are.

Reconstruction: at the clustering layer the similarity of every high-resolution token ``x_i`` to
the final centres is recorded: its ``k`` nearest centres (``reconstruct_k``) with weights
``softmax(−‖x_i − s_j‖² / τ)`` over those ``k`` (the same τ). A cluster-token sequence ``S'`` read
later becomes ``x'_i = Σ_j W_ij s'_j``, the prefix tokens as they are. Where the groups are read
(:mod:`pullback_ext.prune.token_maps`), each patch token counts as held by its nearest centre.

Where features are read: the paper places the reconstruction layer after block α+β, before the
dense head; here it sits after the last block (β = all remaining blocks, none run at full
resolution again). Reads before it are served the same way, as the authors serve the DPT hooks:
every full-length read after the clustering layer (the ``take`` blocks of the intermediates, the
final output) is the reconstruction of the cluster tokens of that block; reads before the
clustering layer are the unreduced tokens. A reader's norm (the final norm, ``norm=True``
intermediates) runs on the reconstructed tokens.

Defaults: ``κ = 5`` iterations, ``λ = 5``, ``k = 20``, the values of the authors' released
configurations for plain ViT backbones (DPT); α = layer 10 of a 24-layer ViT-L (the Segmenter
setting) scaled to the model's depth (:func:`default_layer`). τ is a scale of squared feature distances, which the
paper does not fix across models; the default τ = 10 is the authors' DPT setting (their code
multiplies squared distances by 0.1). ``cluster_grid`` has no default (the paper picks it per task,
e.g. 28 × 28 of 40 × 40). Where the paper is silent: a centre whose tokens all give it zero
weight keeps its previous features (rather than becoming 0); assignment is computed densely over
all centres with the non-neighbours masked (the same result as a local computation); the
reconstruction weights sum to 1 over the ``k`` nearest centres. With ``h × w`` = the patch grid the
method is not the identity at τ = 10 (each token softly averages its neighbours); it is as τ → 0,
and exactly with ``cluster_iters=0, reconstruct_k=1``. η counts ``1 − hw / N``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune.matching import working_precision
from pullback_ext.prune.merged_tokens import MergedTokens
from pullback_ext.prune.methods.base import BackboneShape, BlockLoop, BlockLoopMethod, Needs
from pullback_ext.prune.option_checks import check_layer_range, count, is_int, is_real
from pullback_ext.prune.token_maps import report

REFERENCE_LAYER, REFERENCE_DEPTH = 10, 24  # the paper's α for a 24-layer ViT-L


def default_layer(depth: int) -> int:
    """Expedite's clustering layer α for a ``depth``-block model: layer 10 of 24 scaled, at least 1.
    >>> default_layer(24), default_layer(12), default_layer(4)
    (10, 5, 2)
    """
    return min(max(1, round(REFERENCE_LAYER * depth / REFERENCE_DEPTH)), depth - 1)


def grid_side(num_patch: int, cluster_grid: tuple) -> int:
    """The side ``S`` of the square patch grid of ``num_patch`` tokens; raises unless it is square
    and the ``cluster_grid (h, w)`` fits in it."""
    side = math.isqrt(num_patch)
    if side * side != num_patch:
        raise PullbackError(f"strategy 'expedite' needs a square patch grid; got {num_patch} patch tokens")
    if max(cluster_grid) > side:
        raise PullbackError(f"cluster_grid {cluster_grid} must fit in the {side}×{side} patch grid")
    return side


def initial_centres(patches: torch.Tensor, side: int, grid: tuple) -> torch.Tensor:
    """Adaptive average pooling of ``patches [B, S·S, D]`` (row-major grid) to ``grid (h, w)``:
    ``[B, h·w, D]``."""
    b, _, d = patches.shape
    image = patches.transpose(1, 2).reshape(b, d, side, side)
    return torch.nn.functional.adaptive_avg_pool2d(image, grid).reshape(b, d, -1).transpose(1, 2)


def neighbourhood(side: int, grid: tuple, window: int, device) -> torch.Tensor:
    """``[S·S, h·w]`` bool: centre ``j`` is among the ``window × window`` centres around the cell of
    token ``i`` (the cell nearest-neighbour upsampling of the ``h × w`` grid puts at its position)."""
    h, w = grid
    pos = torch.arange(side, device=device)
    cell_row, cell_col = (pos * h) // side, (pos * w) // side  # [S] each
    near_row = (cell_row[:, None] - torch.arange(h, device=device)[None]).abs() <= window // 2  # [S, h]
    near_col = (cell_col[:, None] - torch.arange(w, device=device)[None]).abs() <= window // 2  # [S, w]
    return (near_row[:, None, :, None] & near_col[None, :, None, :]).reshape(side * side, h * w)


def squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``‖a_i − b_j‖²`` ``[B, n, m]`` of ``a [B, n, D]`` and ``b [B, m, D]`` (clamped at 0)."""
    cross = a @ b.transpose(1, 2)
    return (a.square().sum(-1)[:, :, None] + b.square().sum(-1)[:, None, :] - 2 * cross).clamp_min(0)


def assignment(distances: torch.Tensor, allowed: torch.Tensor, tau: float) -> torch.Tensor:
    """Soft assignment ``[B, n, m]``: ``softmax_j(−d_ij / τ)`` over the ``allowed [n, m]`` centres."""
    return (-distances / tau).masked_fill(~allowed, float("-inf")).softmax(dim=-1)


def cluster(patches: torch.Tensor, side: int, options) -> torch.Tensor:
    """The cluster tokens ``[B, h·w, D]`` of ``patches [B, S·S, D]`` (working precision)."""
    grid = options.cluster_grid
    centres = initial_centres(patches, side, grid)
    allowed = neighbourhood(side, grid, options.cluster_window, patches.device)
    for _ in range(options.cluster_iters):
        q = assignment(squared_distances(patches, centres), allowed, options.cluster_tau)  # [B, n, m]
        total = q.sum(dim=1)[..., None]  # [B, m, 1]
        means = torch.einsum("bnm,bnd->bmd", q, patches) / total.clamp_min(torch.finfo(q.dtype).tiny)
        centres = torch.where(total > 0, means, centres)  # a centre no token weights keeps its features
    return centres


class Reconstruction(NamedTuple):
    """The recorded similarity of the high-resolution tokens to the cluster tokens: ``index [B, n, k]``
    (the ``k`` nearest centres of each patch token) and ``weights [B, n, k]`` (summing to 1)."""

    index: torch.Tensor
    weights: torch.Tensor


def reconstruction_weights(patches: torch.Tensor, centres: torch.Tensor, k: int, tau: float) -> Reconstruction:
    """For ``patches [B, n, D]`` and ``centres [B, m, D]``: each token's ``min(k, m)`` nearest centres,
    weighted by ``softmax(−d / τ)`` over them."""
    nearest = torch.topk(squared_distances(patches, centres), min(k, centres.shape[1]), dim=-1, largest=False)
    return Reconstruction(nearest.indices, (-nearest.values / tau).softmax(dim=-1))


def reconstruct(x: torch.Tensor, num_prefix: int, recorded: Optional[Reconstruction]) -> torch.Tensor:
    """Full-length ``[B, N, D]`` from the current tokens ``x [B, p + m, D]``: the prefix as it is, each
    patch token the weighted sum of its recorded centres (``x`` itself before clustering)."""
    if recorded is None:
        return x
    b, n, k = recorded.index.shape
    centres = x[:, num_prefix:]
    picked = torch.gather(centres, 1, recorded.index.reshape(b, n * k, 1).expand(-1, -1, x.shape[-1]))
    rebuilt = torch.einsum("bnk,bnkd->bnd", recorded.weights.to(x.dtype), picked.reshape(b, n, k, -1))
    return torch.cat([x[:, :num_prefix], rebuilt], dim=1)


def cluster_tokens(x: torch.Tensor, num_prefix: int, options) -> tuple[torch.Tensor, Reconstruction]:
    """The token clustering layer on ``x [B, N, D]``: ``([prefix, cluster tokens] [B, p + h·w, D],
    the recorded reconstruction)``."""
    patches = working_precision(x[:, num_prefix:])
    side = grid_side(patches.shape[1], options.cluster_grid)
    centres = cluster(patches, side, options)
    recorded = reconstruction_weights(patches, centres, options.reconstruct_k, options.cluster_tau)
    return torch.cat([x[:, :num_prefix], centres.to(x.dtype)], dim=1), recorded


def run(reduction, x: torch.Tensor, blocks, call_block, split=None, take=()):
    """Run ``blocks`` on ``x [B, N, D]`` with Expedite's clustering before block ``cluster_layer``
    (``reduction``: resolved options with ``strategy="expedite"``; the blocks run whole, ``split``
    is not needed). Returns ``(final [B, N, D], {i: features after block i [B, N, D] for i in
    take})``, reconstructed to full resolution."""
    o, p = reduction.options, reduction.backbone.num_prefix
    state, recorded, taken = MergedTokens(x=x, num_prefix=p), None, {}
    for i, block in enumerate(blocks):
        if i == o.cluster_layer:
            clustered, recorded = cluster_tokens(state.x, p, o)
            state = state.with_x(clustered)
        state = state.with_x(call_block(block, state, None))
        report(i, state.holders if recorded is None else (lambda: nearest_centres(p, recorded)))
        if i in take:
            taken[i] = reconstruct(state.x, p, recorded)
    return reconstruct(state.x, p, recorded), taken


def nearest_centres(num_prefix: int, recorded: Reconstruction) -> torch.Tensor:
    """The holder map ``[B, p + n]`` of the clustered tokens (:mod:`pullback_ext.prune.token_maps`):
    the prefix tokens hold themselves, each patch token is drawn with its nearest cluster token (the
    one its reconstruction weights most; it is rebuilt from its ``k`` nearest)."""
    b = recorded.index.shape[0]
    prefix = torch.arange(num_prefix, device=recorded.index.device).expand(b, num_prefix)
    return torch.cat([prefix, num_prefix + recorded.index[..., 0]], dim=1)


def patch_tokens_per_block(options, num_patch: int, depth: int) -> list[int]:
    """Patch tokens each block processes (the cluster tokens from ``cluster_layer`` on)."""
    grid_side(num_patch, options.cluster_grid)
    clusters = options.cluster_grid[0] * options.cluster_grid[1]
    return [clusters if i >= options.cluster_layer else num_patch for i in range(depth)]


def checked_grid(grid) -> Optional[tuple[int, int]]:
    """``cluster_grid`` as ``(h, w)`` (a square count becomes its square grid), or None."""
    if grid is None:
        return None
    if is_int(grid) and grid >= 1 and math.isqrt(grid) ** 2 == grid:
        return math.isqrt(grid), math.isqrt(grid)
    values = tuple(grid) if isinstance(grid, (list, tuple)) else ()
    if len(values) != 2 or not all(is_int(v) and v >= 1 for v in values):
        raise PullbackError(f"cluster_grid must be None, (h, w) ints >= 1, or a square number of clusters; got {grid!r}")
    return int(values[0]), int(values[1])


@dataclass(frozen=True)
class ExpediteOptions:
    """``cluster_grid``: the ``(h, w)`` grid of cluster tokens, or their count (a square number;
    required); ``cluster_layer``: α, the block whose input is clustered (0-based; None: layer 10 of
    24, scaled); ``cluster_iters``: κ (>= 0); ``cluster_window``: λ, odd, the λ×λ centres a token
    considers; ``cluster_tau``: τ (> 0) of the assignment and the reconstruction;
    ``reconstruct_k``: centres each token is rebuilt from."""

    cluster_grid: Optional[int | tuple[int, int]] = None
    cluster_layer: Optional[int] = None
    cluster_iters: int = 5
    cluster_window: int = 5
    cluster_tau: float = 10.0
    reconstruct_k: int = 20

    def __post_init__(self):
        window, tau = self.cluster_window, self.cluster_tau
        if not is_int(window) or window < 1 or window % 2 == 0:
            raise PullbackError(f"cluster_window must be an odd int >= 1 (the λ×λ centres a token considers); got {window!r}")
        if not is_real(tau) or not 0.0 < float(tau) < float("inf"):
            raise PullbackError(f"cluster_tau must be a finite float > 0; got {tau!r}")
        for name, value in dict(cluster_grid=checked_grid(self.cluster_grid),
                                cluster_layer=count("cluster_layer", self.cluster_layer, 0, True),
                                cluster_iters=count("cluster_iters", self.cluster_iters, 0), cluster_window=int(window),
                                cluster_tau=float(tau), reconstruct_k=count("reconstruct_k", self.reconstruct_k, 1)).items():
            object.__setattr__(self, name, value)


class Expedite(BlockLoopMethod):
    name, short, title = "expedite", "Expedite", "Expedite (tokens clustered after layer alpha, reconstructed for the dense head)"
    options_type = ExpediteOptions
    needs = Needs(no_rotary="clusters the tokens into cluster tokens, which have no rotary position")
    required = ("cluster_grid", "the (h, w) grid of cluster tokens, or their count")
    rules = ("Expedite: local soft k-means into a grid of clusters at one block (authors' rule)",
             "cluster means; full-resolution tokens rebuilt from the k nearest clusters")
    sweep = {"cluster_grid": (144, 121, 100, 81, 64, 49, 36, 25)}

    def resolve(self, options, backbone: BackboneShape) -> dict:
        layer = default_layer(backbone.depth) if options.cluster_layer is None else options.cluster_layer
        check_layer_range((layer,), backbone.depth, False, "cluster_layer")
        return dict(super().resolve(options, backbone), cluster_layer=layer)

    def run(self, reduction, x: torch.Tensor, loop: BlockLoop, take=()):
        return run(reduction, x, loop.blocks, loop.call_block, loop.split, take)

    def patch_tokens_per_block(self, reduction, num_patch: int) -> list:
        return patch_tokens_per_block(reduction.options, num_patch, reduction.backbone.depth)


ORDER = 5
METHODS = (Expedite(),)
