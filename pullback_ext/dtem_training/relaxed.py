"""DTEM's training forward: the authors' continuous relaxation of ToMe's merge
(movinghoon/DTEM@13f2046, ``dtem/dtem.py:113-191``), on the full-length sequence.

In every block, between attention and MLP, with the ``n`` tokens that still take part (the
prefix first; all of them at block 0):

1. **split**: A = positions ``p, p+2, …``, B = ``p+1, p+3, …`` below ``n`` (``x[1:n:2]``,
   ``x[2:n:2]`` with one class token, ``dtem/dtem.py:160-162``: the opposite parity of the
   inference split, as the authors have it); scores ``s_ab = m̂_a · m̂_b`` of the unit decoupled
   embeddings of the block's input (read detached, ``dtem/dtem.py:44-47``);
2. **soft grouping** (:func:`soft_group`, ``_select``, ``dtem/dtem.py:113-148``): each A token keeps
   its ``k2`` best scores, divided by ``τ1``; ``r`` rounds of a softmax at ``τ2`` over all those
   entries of the image, added up, each round damping the rows it picked by ``log(max(1 − row
   mass, ε))`` (ε: float32's eps); rows over 1 divided by their (detached) total; ``assign [|A|,
   |B|]``;
3. **soft merging** (:func:`soft_merge`, ``dtem/dtem.py:171-175``): ``x_b ← (w_b x_b + Σ_a assign_ab
   w_a x_a) / w_b'``, ``w_b' = w_b + Σ_a assign_ab w_a``, ``w_a ← w_a · c(1 − Σ_b assign_ab)`` (``c``
   the clamp to [0, 1], straight-through), ``x_a`` unchanged;
4. **reorder** (``dtem/dtem.py:178-191``): ``[prefix, A ∪ B by size descending (ties by position),
   the other tokens]`` and ``n ← n − r``: the softly merged-away tokens leave later merges but still
   attend, with their size, through proportional attention (``+ log size`` on the logits).

``r`` is clipped to ``(n − p) // 2`` (``dtem/dtem.py:157``). Full-length features (what a dense
decoder or a pooling head reads) are ``S · x`` with ``S [N, N]`` the soft source matrix: original
token ``t`` is held by current token ``j`` with weight ``S_tj`` (``S`` starts as the identity; a
merge moves ``assign_ab`` of A token ``a``'s share to ``b`` and keeps ``c(1 − Σ_b assign_ab)``);
its column sums are the sizes, and with a one-hot ``assign`` it is ToMe's merge-and-restore. The
authors train a class-token head only and keep no such matrix; it is ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from pullback_ext.errors import PullbackError
from pullback_ext.prune.matching import working_precision
from pullback_ext.prune.merged_tokens import MergedTokens
from pullback_ext.prune.methods.dtem import DTEM

EPSILON = torch.finfo(torch.float32).eps  # the floor of the row mask, float32's eps whatever the dtype (dtem/dtem.py:114)


@dataclass(frozen=True)
class Relaxation:
    """The soft grouping's settings, the authors' defaults (``train.py:57-59``): ``k2`` candidate B
    tokens per A token, temperatures ``tau1`` (of the scores) and ``tau2`` (of each round's softmax)."""

    k2: int = 3
    tau1: float = 0.1
    tau2: float = 0.1

    def __post_init__(self):
        if not isinstance(self.k2, int) or isinstance(self.k2, bool) or self.k2 < 1:
            raise PullbackError(f"k2: expected an int >= 1 (candidate B tokens per A token), got {self.k2!r}")
        for name in ("tau1", "tau2"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise PullbackError(f"{name}: expected a positive finite temperature, got {value!r}")


class SoftTokens(NamedTuple):
    """The relaxed token state: ``x [B, N, D]`` all tokens, ``sizes [B, N]`` their effective sizes,
    ``source [B, N, N]`` (original token, current token) shares, ``active`` the tokens that still
    take part in merging (prefix included); ``energy [B, N]`` (or None) an additive quantity merged
    as the sizes are (the guarded merge's energies, :mod:`pullback_ext.dtem_training.importance`)."""

    x: torch.Tensor
    sizes: torch.Tensor
    source: torch.Tensor
    active: int
    energy: Optional[torch.Tensor] = None

    def full(self) -> torch.Tensor:
        """Full-length features ``[B, N, D]``: original token t is ``Σ_j S_tj x_j``."""
        return self.source @ self.x


def soft_group(scores: torch.Tensor, count: int, relax: Relaxation) -> torch.Tensor:
    """``assign [B, |A|, |B|]``: the soft selection of ``count`` (A, B) edges from the scores
    ``scores [B, |A|, |B|]`` (higher: a better merge; DTEM's cosines, see the module docstring, step 2)."""
    s = working_precision(scores)
    top = torch.argsort(s, dim=-1, descending=True, stable=True)[..., :relax.k2]
    z = torch.gather(s, -1, top) / relax.tau1
    b, rows, kept = z.shape
    khot = torch.zeros_like(z)
    for _ in range(count):
        picked = torch.softmax(z.reshape(b, -1) / relax.tau2, dim=-1).reshape(b, rows, kept)
        khot = khot + picked
        z = z + torch.log(torch.clamp(1 - picked.sum(dim=-1, keepdim=True), min=EPSILON))
    total = torch.clamp(khot.sum(dim=-1, keepdim=True).detach() - 1, min=0.0) + 1.0
    return torch.zeros_like(s).scatter_add(-1, top, khot / total)


# scores [B, |A|, |B|] of a window's A tokens (first slice) against its B tokens (second slice)
Scores = Callable[[SoftTokens, slice, slice], torch.Tensor]


def cosine_scores(metric: torch.Tensor) -> Scores:
    """DTEM's scores: ``m̂_a · m̂_b`` of the unit embeddings ``metric [B, N, d]`` of the current tokens."""
    unit = F.normalize(working_precision(metric), dim=-1)
    return lambda tokens, a, b: unit[:, a] @ unit[:, b].transpose(1, 2)


def _soft_sum(w: torch.Tensor, a: slice, b: slice, assign: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """An additive quantity ``w [B, N]`` (sizes, energies) after the soft merge, in the order ``[A, B]``."""
    return torch.cat([w[:, a] * keep, w[:, b] + (assign.transpose(1, 2) @ w[:, a, None])[..., 0]], dim=1)


def _window(tokens: SoftTokens, scores: Scores, p: int, count: int, relax: Relaxation, tome_split: bool = False):
    """``(x, sizes, source, energy)`` of the merged A and B tokens, in the order ``[A, B]``; A the
    positions ``p, p+2, …`` (DTEM's split) or, with ``tome_split``, the even positions from ``p`` on
    (ToMe's inference split, :func:`~pullback_ext.prune.methods.merging.alternating_order`)."""
    x, sizes, source, n, energy = tokens
    first = p + p % 2 if tome_split else p
    a, b = slice(first, n, 2), slice(2 * p + 1 - first, n, 2)
    assign = soft_group(scores(tokens, a, b), count, relax).to(x.dtype)
    w_a, w_b = sizes[:, a], sizes[:, b]
    given = assign.transpose(1, 2)
    w_b_new = w_b + (given @ w_a[..., None])[..., 0]
    x_b = (w_b[..., None] * x[:, b] + given @ (w_a[..., None] * x[:, a])) / w_b_new[..., None]
    left = 1 - assign.sum(dim=-1)
    keep = left + (left.clamp(0.0, 1.0) - left).detach()
    s_a = source[:, :, a]
    return (torch.cat([x[:, a], x_b], dim=1), torch.cat([w_a * keep, w_b_new], dim=1),
            torch.cat([s_a * keep[:, None, :], source[:, :, b] + s_a @ assign], dim=2),
            None if energy is None else _soft_sum(energy, a, b, assign, keep))


def soft_merge(tokens: SoftTokens, scores: Scores, p: int, r: int, relax: Relaxation, tome_split: bool = False) -> SoftTokens:
    """One relaxed merge of ``r`` tokens (clipped to ``(n − p) // 2``) of ``tokens`` (``p`` prefix
    tokens), the edges chosen by ``scores`` (:func:`cosine_scores` of DTEM's decoupled embedding),
    A and B split as :func:`_window` says;
    the tokens reordered ``[prefix, A ∪ B by size descending, the rest]`` and ``active`` lowered by
    the count."""
    n = tokens.active
    count = min(int(r), (n - p) // 2)
    x, sizes, source, energy = _window(tokens, scores, p, count, relax, tome_split)
    order = torch.argsort(sizes, dim=1, descending=True, stable=True)
    x = torch.gather(x, 1, order[..., None].expand(-1, -1, x.shape[-1]))
    source = torch.gather(source, 2, order[:, None, :].expand(-1, source.shape[1], -1))
    head, tail = slice(0, p), slice(n, None)

    def placed(w: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return torch.cat([old[:, head], torch.gather(w, 1, order), old[:, tail]], dim=1)

    return SoftTokens(x=torch.cat([tokens.x[:, head], x, tokens.x[:, tail]], dim=1), sizes=placed(sizes, tokens.sizes),
                      source=torch.cat([tokens.source[:, :, head], source, tokens.source[:, :, tail]], dim=2),
                      active=n - count, energy=None if energy is None else placed(energy, tokens.energy))


def start(x: torch.Tensor) -> SoftTokens:
    """The relaxed state of the block-0 input ``x [B, N, D]``: sizes 1, each token its own source."""
    b, n, _ = x.shape
    eye = torch.eye(n, dtype=x.dtype, device=x.device).expand(b, n, n)
    return SoftTokens(x=x, sizes=x.new_ones(b, n), source=eye, active=n)


def run_relaxed(embedding, x: torch.Tensor, loop, num_prefix: int, r: int, relax: Relaxation, take=()):
    """The relaxed forward of ``loop.blocks`` on ``x [B, N, D]``: every block merges ``r`` tokens
    softly, on ``embedding.metric(i, block input)``. Returns ``(final [B, N, D], {i: features after
    block i [B, N, D] for i in take})``, full-length (:meth:`SoftTokens.full`)."""
    tokens, taken = start(x), {}
    tiny = torch.finfo(x.dtype).tiny  # log(0) would give the clamped sizes an infinite gradient
    for i, block in enumerate(loop.blocks):
        bias = tokens.sizes.clamp_min(tiny).log()[:, None, None, :]
        attended = loop.split.attend(block, MergedTokens(x=tokens.x, num_prefix=num_prefix), bias)
        metric = embedding.metric(i, tokens.x.detach())
        tokens = soft_merge(tokens._replace(x=attended.x), cosine_scores(metric), num_prefix, r, relax)
        tokens = tokens._replace(x=loop.split.feed_forward(block, tokens.x))
        if i in take:
            taken[i] = tokens.full()
    return tokens.full(), taken


def merge_counts(r: int, num_prefix: int, num_patch: int, depth: int) -> list[int]:
    """The tokens each of ``depth`` relaxed blocks merges: ``r`` clipped to ``(n − p) // 2``."""
    n, counts = num_prefix + num_patch, []
    for _ in range(depth):
        counts.append(min(int(r), (n - num_prefix) // 2))
        n -= counts[-1]
    return counts


class RelaxedDTEM(DTEM):
    """DTEM with the training forward (:func:`run_relaxed`, constant ``r`` in every block, the
    authors' training schedule) in place of the deployed loop."""

    def __init__(self, relax: Relaxation = Relaxation()):
        self.relax = relax

    def run(self, reduction, x: torch.Tensor, loop, take=()):
        o = reduction.options
        if o.schedule != "constant" or o.block_range not in (None, (0, reduction.backbone.depth)):
            raise PullbackError("the relaxed DTEM forward merges r tokens in every block (schedule 'constant', block_range None)")
        return run_relaxed(o.head, x, loop, reduction.backbone.num_prefix, o.r, self.relax, take)
