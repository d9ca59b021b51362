"""Argument validation of the fused ops: the one place that every path of :mod:`pullback_ext.ops` checks.

Each op has one function here. Its front end in :mod:`pullback_ext.ops` calls it before running
either the compiled kernel or the pure-torch reference, and its fake kernel calls it (metadata
only), so an eager call, a FakeTensor and ``torch.compile`` report a bad argument alike:

- metadata (ranks, shapes, dtypes, devices), always, through ``_require``: a symbolic shape
  under ``torch.compile`` or a FakeTensor becomes a guard or a runtime assert, not a graph break;
- ``values=True``: the checks that read tensor data (lam >= 0, w >= 0, indices in range, not
  repeated, a permutation), one device-to-host synchronisation per check stage on CUDA;
- ``finite=True``: no NaN or infinite value in the floating inputs.

Exceptions: :class:`~pullback_ext.errors.PullbackError` (a ``ValueError``) for shapes and values,
``TypeError`` for dtypes, ``IndexError`` for indices out of range. The compiled kernels keep only
the invariants that protect memory (``csrc/invariants.h``).

Shapes: B batch, N tokens, D channels, P = N·D ambient dimension, r rank, k vectors.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from pullback_ext.errors import PullbackError

# A mask that marks the failing entries of a value check, and the exception to raise if any is set.
_Failure = tuple[Tensor, Callable[[], Exception]]


def _require(cond, error: type[Exception], message: Callable[[], str]) -> None:
    """Raise ``error(message())`` unless ``cond``.

    A symbolic ``cond`` (a shape under ``torch.compile(dynamic=True)`` or a FakeTensor) goes to
    ``torch._check_with``, which decides it or defers it as a runtime assert; while dynamo traces
    the front ends it becomes a guard instead (dynamo only converts message closures over
    constants, and these name tensors)."""
    if cond is True:
        return
    if cond is False or torch.compiler.is_compiling():
        if not cond:
            raise error(message())
        return
    torch._check_with(error, cond, message)


def _dims(t: Tensor, name: str, dim: int, layout: str) -> None:
    _require(t.dim() == dim, PullbackError,
             lambda: f"{name} must have {dim} dimensions {layout}, got shape {list(t.shape)}")


def _shape(t: Tensor, name: str, expected: tuple, layout: str) -> None:
    """``t.shape == expected`` where ``expected`` is not None; ``layout`` names the dimensions."""
    _dims(t, name, len(expected), layout)

    def message() -> str:
        pattern = ", ".join("*" if e is None else str(e) for e in expected)
        return f"{name} must have shape {layout} = [{pattern}], got {list(t.shape)}"

    for size, want in zip(t.shape, expected):
        if want is not None:
            _require(size == want, PullbackError, message)


def _batch3(t: Tensor, name: str, layout: str) -> None:
    """A floating tensor of 3 dimensions (``layout``) with a batch B >= 1."""
    _dims(t, name, 3, layout)
    _require(t.shape[0] >= 1, PullbackError,
             lambda: f"{name} has an empty batch (B = 0, shape {list(t.shape)}); expected B >= 1")
    _require(t.is_floating_point(), TypeError, lambda: f"{name} must be a floating-point tensor, got {t.dtype}")


def _like(t: Tensor, name: str, ref: Tensor, ref_name: str) -> None:
    _require(t.device == ref.device, PullbackError,
             lambda: f"{name} must be on the device of {ref_name} ({ref.device}), got {t.device}")
    _require(t.dtype == ref.dtype, TypeError,
             lambda: f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")


def _index(idx: Tensor, name: str, ref: Tensor, ref_name: str) -> None:
    """An int64 index tensor [B, K] with ``ref``'s batch, on ``ref``'s device."""
    _require(idx.dtype == torch.int64, TypeError, lambda: f"{name} must be an int64 index tensor, got {idx.dtype}")
    _shape(idx, name, (ref.shape[0], None), "[B, K]")
    _require(idx.device == ref.device, PullbackError,
             lambda: f"{name} must be on the device of {ref_name} ({ref.device}), got {idx.device}")


def _tall(U: Tensor, name: str) -> None:
    """A batch of tall-skinny floating matrices [B, P, r] with 1 <= r <= P."""
    _batch3(U, name, "[B, P, r]")

    def message() -> str:
        return f"{name} must be tall with 1 <= r <= P (shape [B, P, r]), got r = {U.shape[2]}, P = {U.shape[1]}"

    _require(U.shape[2] >= 1, PullbackError, message)
    _require(U.shape[2] <= U.shape[1], PullbackError, message)


# --- value checks: built as masks on the device, fetched together ------------------------------


def _raise_first(failures: list[_Failure]) -> None:
    """Raise the exception of the first failure whose mask has a set entry (one transfer for all)."""
    flags = torch.stack([mask.any() for mask, _ in failures]).tolist()
    for flag, (_, error) in zip(flags, failures):
        if flag:
            raise error()


def _first(mask: Tensor) -> tuple[int, ...]:
    return tuple(int(c) for c in mask.nonzero()[0])


def _out_of_range(idx: Tensor, name: str, bound: int) -> _Failure:
    bad = (idx < 0) | (idx >= bound)

    def error() -> Exception:
        b, i = _first(bad)
        return IndexError(f"{name}[{b}, {i}] = {int(idx[b, i])} is out of range: expected 0 <= index < {bound}")

    return bad, error


def _negative(t: Tensor, name: str) -> _Failure:
    bad = t < 0
    return bad, lambda: PullbackError(f"{name} must be >= 0 everywhere, got a minimum of {float(t[bad].min())}")


def _repeated(rows: Tensor, message: Callable[[int, int], str]) -> _Failure:
    """Rows [B, K] that hold a value twice; ``message(image, value)`` describes the first."""
    ordered = rows.sort(dim=1).values
    same = ordered[:, 1:] == ordered[:, :-1]

    def error() -> Exception:
        b, i = _first(same)
        return PullbackError(message(b, int(ordered[b, i])))

    return same, error


def _finite(**tensors: Tensor) -> None:
    """Every element finite (``check_finite=True``); one transfer for all tensors."""
    counts = torch.stack([(~torch.isfinite(t)).sum() for t in tensors.values()]).tolist()
    for (name, _), bad in zip(tensors.items(), counts):
        if bad:
            raise PullbackError(f"{name} contains {bad} NaN or infinite value(s) (check_finite=True)")


# --- one function per op --------------------------------------------------------------------


def _factor(U: Tensor, lam: Tensor) -> None:
    _tall(U, "U")
    _shape(lam, "lam", (U.shape[0], U.shape[2]), "[B, r]")
    _like(lam, "lam", U, "U")


def lowrank_metric(U: Tensor, lam: Tensor, v: Tensor, eps: float, *, values: bool = False,
                   finite: bool = False) -> None:
    """lowrank_metric_apply / _quadform: U [B,P,r] (1 <= r <= P), lam [B,r] >= 0, v [B,P,k] (k >= 1)
    of U's dtype and device, eps finite and >= 0."""
    _factor(U, lam)
    _shape(v, "v", (U.shape[0], U.shape[1], None), "[B, P, k]")
    _require(v.shape[2] >= 1, PullbackError, lambda: f"v must hold k >= 1 vectors (shape [B, P, k]), got {list(v.shape)}")
    _like(v, "v", U, "U")
    _require(math.isfinite(eps) and eps >= 0, PullbackError, lambda: f"eps must be a finite value >= 0, got {eps}")
    if values:
        _raise_first([_negative(lam, "lam")])
    if finite:
        _finite(U=U, lam=lam, v=v)


def token_importance(U: Tensor, lam: Tensor, num_tokens: int, *, values: bool = False, finite: bool = False) -> None:
    """U [B,N·D,r] (1 <= r <= P), lam [B,r] >= 0 of U's dtype and device, num_tokens = N >= 1 dividing P."""
    _factor(U, lam)
    _require(num_tokens >= 1, PullbackError, lambda: f"num_tokens must be >= 1, got {num_tokens}")
    _require(U.shape[1] % num_tokens == 0, PullbackError,
             lambda: f"num_tokens must divide P = {U.shape[1]} (U has shape [B, N*D, r]), got num_tokens = {num_tokens}")
    if values:
        _raise_first([_negative(lam, "lam")])
    if finite:
        _finite(U=U, lam=lam)


def block_orthonormalize(X: Tensor, *, finite: bool = False) -> None:
    """X [B,P,r] floating with 1 <= r <= P (it has no value checks)."""
    _tall(X, "X")
    if finite:
        _finite(X=X)


def gather_tokens(x: Tensor, idx: Tensor, *, values: bool = False, finite: bool = False) -> None:
    """x [B,N,D] floating, idx [B,K] int64 on x's device with every index in [0, N)."""
    _batch3(x, "x", "[B, N, D]")
    _index(idx, "idx", x, "x")
    if values:
        _raise_first([_out_of_range(idx, "idx", x.shape[1])])
    if finite:
        _finite(x=x)


def merge_tokens(x: Tensor, w: Tensor, src_idx: Tensor, dst_idx: Tensor, *, values: bool = False,
                 finite: bool = False) -> None:
    """x [B,N,D], w [B,N] >= 0 of x's dtype and device, src_idx [B,R] (R < N) of distinct tokens in
    [0, N), dst_idx [B,R] in [0, N) outside src_idx (both int64)."""
    _batch3(x, "x", "[B, N, D]")
    B, N, _ = x.shape
    _shape(w, "w", (B, N), "[B, N]")
    _like(w, "w", x, "x")
    _index(src_idx, "src_idx", x, "x")
    _index(dst_idx, "dst_idx", x, "x")
    R = src_idx.shape[1]
    _shape(dst_idx, "dst_idx", (B, R), "[B, R] (the shape of src_idx)")
    _require(R < N, PullbackError, lambda: f"src_idx must merge fewer than N = {N} tokens per image, got R = {R}")
    if values:
        _raise_first([_out_of_range(src_idx, "src_idx", N), _out_of_range(dst_idx, "dst_idx", N), _negative(w, "w")])
        _raise_first([_repeated(src_idx, lambda b, t: f"src_idx must not repeat a token within an image: image {b} "
                                                      f"repeats {t}"), _merged_away(src_idx, dst_idx, N)])
    if finite:
        _finite(x=x, w=w)


def _merged_away(src_idx: Tensor, dst_idx: Tensor, N: int) -> _Failure:
    """dst_idx entries that src_idx merges away too (both in range)."""
    merged = torch.zeros(src_idx.shape[0], N, dtype=torch.bool, device=src_idx.device).scatter(1, src_idx, True)
    clash = merged.gather(1, dst_idx)

    def error() -> Exception:
        b, i = _first(clash)
        return PullbackError(f"dst_idx must point at tokens that are kept: dst_idx[{b}, {i}] = {int(dst_idx[b, i])} "
                             "is also merged away")

    return clash, error


def reinsert_tokens(kept: Tensor, kept_idx: Tensor, pruned: Tensor, pruned_idx: Tensor, *, values: bool = False,
                    finite: bool = False) -> None:
    """kept [B,K,D], pruned [B,R,D] of kept's dtype and device, K + R >= 1, kept_idx [B,K] and
    pruned_idx [B,R] int64 that together hold every position 0..K+R-1 exactly once per image."""
    _batch3(kept, "kept", "[B, K, D]")
    B, K, D = kept.shape
    _shape(pruned, "pruned", (B, None, D), "[B, R, D] (B and D of kept)")
    _like(pruned, "pruned", kept, "kept")
    _index(kept_idx, "kept_idx", kept, "kept")
    _shape(kept_idx, "kept_idx", (B, K), "[B, K] (B and K of kept)")
    _index(pruned_idx, "pruned_idx", kept, "kept")
    _shape(pruned_idx, "pruned_idx", (B, pruned.shape[1]), "[B, R] (B and R of pruned)")
    N = K + pruned.shape[1]
    _require(N >= 1, PullbackError, lambda: "kept and pruned together must hold at least one token, got K = R = 0")
    if values:
        _raise_first([_out_of_range(kept_idx, "kept_idx", N), _out_of_range(pruned_idx, "pruned_idx", N)])
        _raise_first([_repeated(torch.cat([kept_idx, pruned_idx], dim=1),
                                lambda b, t: f"kept_idx and pruned_idx must together cover 0..{N - 1} exactly "
                                             f"once per image: image {b} has {t} twice")])
    if finite:
        _finite(kept=kept, pruned=pruned)


MERGE_RULES = ("tome", "cosine", "bound", "pitome", "pitome_protected")


def merge_step(x: Tensor, keys: Tensor, sizes, energy, owner, positions, num_prefix: int, r: int, rule: str, *,
               finite: bool = False) -> None:
    """x [B,K,D]; keys [B,H,K,hd] of x's dtype and device; sizes [B,K] of x's dtype (or None); energy
    [B,K] in x's working precision (or None; required by the guarded rules); owner [B,N] and positions
    [B,K] int64 (or None); 0 <= num_prefix <= K, r >= 0, rule one of :data:`MERGE_RULES`."""
    _batch3(x, "x", "[B, K, D]")
    B, K, _ = x.shape
    _dims(keys, "keys", 4, "[B, H, K, hd]")
    _shape(keys, "keys", (B, None, K, None), "[B, H, K, hd]")
    _like(keys, "keys", x, "x")
    if sizes is not None:
        _shape(sizes, "sizes", (B, K), "[B, K]")
        _like(sizes, "sizes", x, "x")
    if energy is not None:
        _shape(energy, "energy", (B, K), "[B, K]")
        _require(energy.device == x.device, PullbackError,
                 lambda: f"energy must be on the device of x ({x.device}), got {energy.device}")
        working = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        _require(energy.dtype == working, TypeError,
                 lambda: f"energy must be {working} (x's working precision), got {energy.dtype}")
    if owner is not None:
        _index(owner, "owner", x, "x")
    if positions is not None:
        _index(positions, "positions", x, "x")
        _shape(positions, "positions", (B, K), "[B, K]")
    if not isinstance(num_prefix, int) or not 0 <= num_prefix <= K:
        raise PullbackError(f"num_prefix must be an int in [0, K = {K}], got {num_prefix!r}")
    if not isinstance(r, int) or r < 0:
        raise PullbackError(f"r must be an int >= 0 (merges asked for), got {r!r}")
    if rule not in MERGE_RULES:
        raise PullbackError(f"rule must be one of {', '.join(MERGE_RULES)}, got {rule!r}")
    if rule in ("cosine", "bound") and energy is None:
        raise PullbackError(f"rule {rule!r} (importance_tome's guarded cost) needs energy [B, K], got None")
    if finite:
        _finite(x=x, keys=keys, **({} if sizes is None else {"sizes": sizes}),
                **({} if energy is None else {"energy": energy}))


def select_with_partners(order: Tensor, partner: Tensor, count: int, *, values: bool = False) -> None:
    """order [B,n] int64 with every row a permutation of 0..n-1, partner [B,n] int64 on order's device
    with every partner in [0, n), count an int with 0 <= count <= n."""
    _require(order.dtype == torch.int64, TypeError, lambda: f"order must be an int64 index tensor, got {order.dtype}")
    _dims(order, "order", 2, "[B, n]")
    n = order.shape[1]
    _index(partner, "partner", order, "order")
    _shape(partner, "partner", (order.shape[0], n), "[B, n] (the shape of order)")
    _require(isinstance(count, int) and not isinstance(count, bool), TypeError,
             lambda: f"count must be an int, got {type(count).__name__}")
    _require(count >= 0, PullbackError, lambda: f"count must be >= 0, got {count}")
    _require(count <= n, PullbackError, lambda: f"count must be <= n = {n} (order has shape [B, n]), got {count}")
    if values:
        _raise_first([_out_of_range(order, "order", n), _out_of_range(partner, "partner", n)])
        _raise_first([_repeated(order, lambda b, t: f"order must be a permutation of 0..{n - 1} in every row: "
                                                    f"row {b} holds {t} twice")])


AGGLOMERATION_LINKAGES = ("average", "single", "complete", "bound")


def agglomerate(dist: Tensor, sizes, energy, count: int, linkage: str, *, values: bool = False,
                finite: bool = False) -> None:
    """dist [B,n,n] floating; sizes and energy [B,n] of dist's dtype and device with ``linkage="bound"``,
    else None; count an int with min(1, n) <= count <= n; ``values``: dist symmetric, sizes > 0,
    energy >= 0."""
    _batch3(dist, "dist", "[B, n, n]")
    B, n = dist.shape[0], dist.shape[1]
    _shape(dist, "dist", (B, n, n), "[B, n, n]")
    if linkage not in AGGLOMERATION_LINKAGES:
        raise PullbackError(f"linkage must be one of {', '.join(AGGLOMERATION_LINKAGES)}, got {linkage!r}")
    bound = linkage == "bound"
    for name, t in (("sizes", sizes), ("energy", energy)):
        if bound and t is None:
            raise PullbackError(f"linkage 'bound' needs {name} [B, n], got None")
        if not bound and t is not None:
            raise PullbackError(f"{name} is read by linkage 'bound' only; got a tensor with linkage {linkage!r}")
        if t is not None:
            _shape(t, name, (B, n), "[B, n]")
            _like(t, name, dist, "dist")
    _require(isinstance(count, int) and not isinstance(count, bool), TypeError,
             lambda: f"count must be an int, got {type(count).__name__}")
    _require(count <= n, PullbackError, lambda: f"count must be <= n = {n} (dist has shape [B, n, n]), got {count}")
    _require(count >= min(1, n), PullbackError, lambda: f"count must be >= 1 (clusters kept), got {count}")
    if finite:
        _finite(dist=dist, **({"sizes": sizes, "energy": energy} if bound else {}))
    if values:
        mirror = dist.transpose(1, 2)
        asymmetric = (dist != mirror) & ~(dist.isnan() & mirror.isnan())

        def not_symmetric() -> Exception:
            b, i, j = _first(asymmetric)
            return PullbackError(f"dist must be symmetric: dist[{b}, {i}, {j}] = {float(dist[b, i, j])} but "
                                 f"dist[{b}, {j}, {i}] = {float(dist[b, j, i])}")

        failures = [(asymmetric, not_symmetric)]
        if bound:
            failures += [(~(sizes > 0), lambda: PullbackError(f"sizes must be > 0 everywhere, got a minimum of "
                                                               f"{float(sizes.min())}")),
                         _negative(energy, "energy")]
        _raise_first(failures)
