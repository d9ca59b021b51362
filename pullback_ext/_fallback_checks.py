"""Argument checks for the pure-torch fallback path of :mod:`pullback_ext.ops`.

The compiled ops validate in C++ (csrc/ops/checks.cpp); these mirror those checks, with the same
exception types (ValueError for shapes and values, TypeError for dtypes, IndexError for indices),
for the inputs that run on :mod:`pullback_ext.reference` instead.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _shape(t: Tensor, name: str, expected: tuple, layout: str) -> None:
    if t.dim() != len(expected):
        raise ValueError(f"{name} must have {len(expected)} dimensions {layout}, got shape {list(t.shape)}")
    if any(e is not None and s != e for s, e in zip(t.shape, expected)):
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name} must have shape {layout} = {want}, got {list(t.shape)}")


def _float(t: Tensor, name: str) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _like(t: Tensor, name: str, ref: Tensor, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} must be on the device of {ref_name} ({ref.device}), got {t.device}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")


def _batch(t: Tensor, name: str) -> None:
    if t.dim() >= 1 and t.shape[0] == 0:
        raise ValueError(f"{name} has an empty batch (B = 0, shape {list(t.shape)}); expected B >= 1")


def _finite(name: str, t: Tensor) -> None:
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ValueError(f"{name} contains {bad} NaN or infinite value(s) (check_finite=True)")


def _nonnegative(t: Tensor, name: str) -> None:
    if t.numel() and float(t.min()) < 0:
        raise ValueError(f"{name} must be >= 0 everywhere, got a minimum of {float(t.min())}")


def _index(idx: Tensor, name: str, ref: Tensor, ref_name: str, batch: int, bound: int) -> None:
    if idx.dtype != torch.int64:
        raise TypeError(f"{name} must be an int64 index tensor, got {idx.dtype}")
    _shape(idx, name, (batch, None), "[B, K]")
    if idx.device != ref.device:
        raise ValueError(f"{name} must be on the device of {ref_name} ({ref.device}), got {idx.device}")
    bad = (idx < 0) | (idx >= bound)
    if bool(bad.any()):
        b, i = (int(c) for c in bad.nonzero()[0])
        raise IndexError(f"{name}[{b}, {i}] = {int(idx[b, i])} is out of range: expected 0 <= index < {bound}")


def _repeats(rows: Tensor) -> tuple[int, int] | None:
    """(image, token) of the first token repeated within a row of ``rows`` [B, K], else None."""
    ordered = rows.sort(dim=1).values
    same = ordered[:, 1:] == ordered[:, :-1]
    if not bool(same.any()):
        return None
    b, i = (int(c) for c in same.nonzero()[0])
    return b, int(ordered[b, i])


def factor(U: Tensor, lam: Tensor, check_finite: bool) -> None:
    _shape(U, "U", (None, None, None), "[B, P, r]")
    _batch(U, "U")
    _float(U, "U")
    B, P, r = U.shape
    if not 1 <= r <= P:
        raise ValueError(f"U must have 1 <= r <= P (shape [B, P, r]), got r = {r}, P = {P}")
    _shape(lam, "lam", (B, r), "[B, r]")
    _like(lam, "lam", U, "U")
    if check_finite:
        _finite("U", U)
        _finite("lam", lam)
    _nonnegative(lam, "lam")


def metric(U: Tensor, lam: Tensor, v: Tensor, eps: float, check_finite: bool) -> None:
    factor(U, lam, check_finite)
    _shape(v, "v", (U.shape[0], U.shape[1], None), "[B, P, k]")
    if v.shape[2] < 1:
        raise ValueError(f"v must hold k >= 1 vectors (shape [B, P, k]), got {list(v.shape)}")
    _like(v, "v", U, "U")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite value >= 0, got {eps}")
    if check_finite:
        _finite("v", v)


def importance(U: Tensor, lam: Tensor, num_tokens: int, check_finite: bool) -> None:
    factor(U, lam, check_finite)
    if num_tokens < 1 or U.shape[1] % num_tokens:
        raise ValueError(f"num_tokens must be >= 1 and divide P = {U.shape[1]}, got num_tokens = {num_tokens}")


def qr(X: Tensor, check_finite: bool) -> None:
    _shape(X, "X", (None, None, None), "[B, P, r]")
    _batch(X, "X")
    _float(X, "X")
    if not 1 <= X.shape[2] <= X.shape[1]:
        raise ValueError(f"X must be tall with 1 <= r <= P (shape [B, P, r]), got {list(X.shape)}")
    if check_finite:
        _finite("X", X)


def gather(x: Tensor, idx: Tensor, check_finite: bool) -> None:
    _shape(x, "x", (None, None, None), "[B, N, D]")
    _batch(x, "x")
    _float(x, "x")
    _index(idx, "idx", x, "x", x.shape[0], x.shape[1])
    if check_finite:
        _finite("x", x)


def merge(x: Tensor, w: Tensor, src_idx: Tensor, dst_idx: Tensor, check_finite: bool) -> None:
    _shape(x, "x", (None, None, None), "[B, N, D]")
    _batch(x, "x")
    _float(x, "x")
    B, N, _ = x.shape
    _shape(w, "w", (B, N), "[B, N]")
    _like(w, "w", x, "x")
    _index(src_idx, "src_idx", x, "x", B, N)
    _index(dst_idx, "dst_idx", x, "x", B, N)
    R = src_idx.shape[1]
    _shape(dst_idx, "dst_idx", (B, R), "[B, R] (the shape of src_idx)")
    if R >= N:
        raise ValueError(f"src_idx must merge fewer than N = {N} tokens per image, got R = {R}")
    repeated = _repeats(src_idx)
    if repeated is not None:
        raise ValueError(f"src_idx must not repeat a token within an image: image {repeated[0]} repeats {repeated[1]}")
    merged_away = torch.zeros(B, N, dtype=torch.bool, device=x.device).scatter(1, src_idx, True)
    clash = merged_away.gather(1, dst_idx)
    if bool(clash.any()):
        b, i = (int(c) for c in clash.nonzero()[0])
        raise ValueError(f"dst_idx must point at tokens that are kept: dst_idx[{b}, {i}] = {int(dst_idx[b, i])} is also merged away")
    if check_finite:
        _finite("x", x)
        _finite("w", w)
    _nonnegative(w, "w")


def reinsert(kept: Tensor, kept_idx: Tensor, pruned: Tensor, pruned_idx: Tensor, check_finite: bool) -> None:
    _shape(kept, "kept", (None, None, None), "[B, K, D]")
    _batch(kept, "kept")
    _float(kept, "kept")
    B, K, D = kept.shape
    _shape(pruned, "pruned", (B, None, D), "[B, R, D] (B and D of kept)")
    _like(pruned, "pruned", kept, "kept")
    N = K + pruned.shape[1]
    if N < 1:
        raise ValueError("kept and pruned together must hold at least one token, got K = R = 0")
    _index(kept_idx, "kept_idx", kept, "kept", B, N)
    _shape(kept_idx, "kept_idx", (B, K), "[B, K] (B and K of kept)")
    _index(pruned_idx, "pruned_idx", kept, "kept", B, N)
    _shape(pruned_idx, "pruned_idx", (B, pruned.shape[1]), "[B, R] (B and R of pruned)")
    repeated = _repeats(torch.cat([kept_idx, pruned_idx], dim=1))
    if repeated is not None:
        raise ValueError(
            f"kept_idx and pruned_idx must together cover 0..{N - 1} exactly once per image: "
            f"image {repeated[0]} has {repeated[1]} twice"
        )
    if check_finite:
        _finite("kept", kept)
        _finite("pruned", pruned)
