"""Fused kernels of pullback_ext (docs/formulas.md §5), with autograd and torch.compile support.

This module is the ops' one Python surface. Each function validates its arguments
(:mod:`pullback_ext._op_checks`), then runs the compiled op ``torch.ops.pullback_ext.<name>`` (from
``pullback_ext._C``) for CPU float32/float64 and, in CUDA builds, CUDA float32/float16/bfloat16/
float64, and the pure-torch :mod:`pullback_ext.reference` for everything else (e.g. CPU float16,
or a source checkout that was never compiled); ``select_with_partners``, on integer indices, runs
compiled on every device the build covers. Wrong shapes or values raise
:class:`~pullback_ext.errors.PullbackError` (a ``ValueError``), wrong dtypes ``TypeError``,
out-of-range indices ``IndexError``, on both paths alike.

``check_finite=True`` additionally rejects NaN/inf inputs (one extra reduction per input).

``check_values=False`` skips the checks that read tensor data (lam >= 0, w >= 0, indices in range,
not repeated, a permutation for reinsertion). On CUDA tensors they cost a device-to-host
synchronisation per call, which stalls the host's launch queue, and under ``torch.compile`` they
break the graph; skip them in hot loops whose values are valid by construction (the pruning
pipeline does). Shapes, dtypes and devices are still checked, and the compiled kernels stay
memory-safe on invalid values: the results are then unspecified (a gathered row with an
out-of-range index is NaN), never an out-of-bounds access. ``torch.compile(fullgraph=True)`` needs
``check_values=False`` (and ``check_finite=False``).

Shapes: B batch, N tokens, D channels, P = N·D ambient dimension, r rank, k vectors.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from pullback_ext import _op_checks, reference
from pullback_ext._loader import load_compiled

__all__ = [
    "lowrank_metric_apply",
    "lowrank_metric_quadform",
    "token_importance",
    "block_orthonormalize",
    "gather_tokens",
    "merge_tokens",
    "reinsert_tokens",
    "select_with_partners",
    "merge_step",
    "agglomerate",
    "uses_compiled",
]

_C = load_compiled()
_CUDA_BUILT = bool(_C is not None and _C.cuda_available())
# A build from before merge_step runs its reference (and the methods their unfused merges).
_HAS_MERGE_STEP = bool(_C is not None and hasattr(torch.ops.pullback_ext, "merge_step"))
_HAS_AGGLOMERATE = bool(_C is not None and hasattr(torch.ops.pullback_ext, "agglomerate"))
_CPU_DTYPES = (torch.float32, torch.float64)
_CUDA_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def uses_compiled(t: Tensor) -> bool:
    """Whether an op whose main input is ``t`` runs the compiled kernel (else the reference)."""
    if _C is None:
        return False
    if t.device.type == "cpu":
        return t.dtype in _CPU_DTYPES
    if t.device.type == "cuda":
        return _CUDA_BUILT and t.dtype in _CUDA_DTYPES
    return t.device.type == "meta" and t.dtype in _CUDA_DTYPES


def merge_step_compiled(x: Tensor) -> bool:
    """Whether :func:`merge_step` on the tokens ``x`` runs the compiled op (else its reference)."""
    return _HAS_MERGE_STEP and uses_compiled(x)


def _run(name: str, main: Tensor, *args):
    """The compiled op ``name`` on ``args`` when it takes ``main``'s dtype and device, else its reference."""
    if uses_compiled(main):
        return getattr(torch.ops.pullback_ext, name)(*args)
    return getattr(reference, name)(*args)


def lowrank_metric_apply(U: Tensor, lam: Tensor, v: Tensor, eps: float, *, check_values: bool = True,
                         check_finite: bool = False) -> Tensor:
    """``g v = eps·v + U (lam ⊙ Uᵀ v)``.

    U [B,P,r] (r <= P), lam [B,r] >= 0, v [B,P,k], eps >= 0 -> [B,P,k].
    """
    _op_checks.lowrank_metric(U, lam, v, eps, values=check_values, finite=check_finite)
    return _run("lowrank_metric_apply", U, U, lam, v, float(eps))


def lowrank_metric_quadform(U: Tensor, lam: Tensor, v: Tensor, eps: float, *, check_values: bool = True,
                            check_finite: bool = False) -> Tensor:
    """``vᵀ g v = eps‖v‖² + Σ_j lam_j ⟨u_j, v⟩²``, reading U once.

    U [B,P,r], lam [B,r] >= 0, v [B,P,k], eps >= 0 -> [B,k].
    """
    _op_checks.lowrank_metric(U, lam, v, eps, values=check_values, finite=check_finite)
    return _run("lowrank_metric_quadform", U, U, lam, v, float(eps))


def token_importance(U: Tensor, lam: Tensor, num_tokens: int, *, check_values: bool = True,
                     check_finite: bool = False) -> Tensor:
    """``imp(t) = sqrt(Σ_j lam_j ‖u_j^(t)‖²)`` with u_j^(t) the rows t·D .. t·D+D-1 of column j.

    U [B,N·D,r], lam [B,r] >= 0, num_tokens = N dividing P -> [B,N].
    """
    _op_checks.token_importance(U, lam, num_tokens, values=check_values, finite=check_finite)
    return _run("token_importance", U, U, lam, int(num_tokens))


def block_orthonormalize(X: Tensor, return_r: bool = False, *, check_finite: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Orthonormal basis of the columns of each X[b]: X [B,P,r] (r <= P) -> Q [B,P,r] (, R [B,r,r]).

    X = Q R with QᵀQ = I, R upper triangular, diag(R) >= 0. CholeskyQR2 with float64 Gram
    accumulation; images whose Cholesky fails or whose condition estimate exceeds 1e6 are
    refactorised by Householder QR, so Q is orthonormal to ~1e-6 in float32 even for rank-deficient
    or badly scaled X. For a rank-deficient X the columns of Q beyond the rank complete the basis
    to an orthonormal set (the matching diagonal entries of R are ~0). It reads no values to
    validate, so it takes no ``check_values``.

    Forward-only: no gradient flows through it; a RuntimeError is raised if one is requested.
    """
    if X.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            "block_orthonormalize is forward-only: X requires grad; pass X.detach() or run it under "
            "torch.no_grad()"
        )
    _op_checks.block_orthonormalize(X, finite=check_finite)
    if uses_compiled(X):
        Q, R = torch.ops.pullback_ext.block_orthonormalize(X)
        return (Q, R) if return_r else Q
    return reference.block_orthonormalize(X, return_r)


def gather_tokens(x: Tensor, idx: Tensor, *, check_values: bool = True, check_finite: bool = False) -> Tensor:
    """``out[b, i] = x[b, idx[b, i]]``: x [B,N,D], idx [B,K] int64 in [0,N) -> [B,K,D]."""
    _op_checks.gather_tokens(x, idx, values=check_values, finite=check_finite)
    return _run("gather_tokens", x, x, idx)


def merge_tokens(
    x: Tensor, w: Tensor, src_idx: Tensor, dst_idx: Tensor, *, check_values: bool = True, check_finite: bool = False
) -> tuple[Tensor, Tensor]:
    """Merge token src_idx[b,i] into dst_idx[b,i], weighted by w, tracking the weights (ToMe sizes).

    x [B,N,D], w [B,N] >= 0, src_idx [B,R] distinct, dst_idx [B,R] not in src_idx ->
    (x' [B,N-R,D], w' [B,N-R]): the tokens not in src_idx in their original order; a dst token d
    becomes ``(w_d x_d + Σ_{s->d} w_s x_s) / (w_d + Σ_{s->d} w_s)`` with weight
    ``w_d + Σ_{s->d} w_s`` (x_d is kept unchanged when that weight is 0).
    """
    _op_checks.merge_tokens(x, w, src_idx, dst_idx, values=check_values, finite=check_finite)
    return _run("merge_tokens", x, x, w, src_idx, dst_idx)


def reinsert_tokens(
    kept: Tensor, kept_idx: Tensor, pruned: Tensor, pruned_idx: Tensor, *, check_values: bool = True,
    check_finite: bool = False,
) -> Tensor:
    """Put every token back at its original position (Last-Layer Fusion).

    kept [B,K,D], kept_idx [B,K], pruned [B,R,D], pruned_idx [B,R]; the two index sets of each
    image together a permutation of 0..K+R-1 -> [B,K+R,D].
    """
    _op_checks.reinsert_tokens(kept, kept_idx, pruned, pruned_idx, values=check_values, finite=check_finite)
    return _run("reinsert_tokens", kept, kept, kept_idx, pruned, pruned_idx)


def select_with_partners(order: Tensor, partner: Tensor, count: int, *, check_values: bool = True) -> Tensor:
    """``count`` tokens per image taken greedily in ``order``, each unless it is the partner of a
    token taken before it; should the spared partners leave the budget short, the first tokens of
    ``order`` not yet taken fill it (the merge sources of ``pullback_ext.prune.matching``).

    order [B,n] int64 (every row a permutation of 0..n-1: the candidates, e.g. cheapest first),
    partner [B,n] int64 in [0, n) (the partner of token t), 0 <= count <= n -> [B,count] int64, the
    selected tokens in increasing order. One sequential pass per image in the compiled kernels (each
    step depends on the earlier ones); the reference is a loop of tensor ops. Integer-valued: every
    device the kernels are built for runs them, and there is no gradient.
    """
    count = operator.index(count)
    _op_checks.select_with_partners(order, partner, count, values=check_values)
    device = order.device.type
    if _C is not None and (device in ("cpu", "meta") or (device == "cuda" and _CUDA_BUILT)):
        return torch.ops.pullback_ext.select_with_partners(order, partner, count)
    return reference.select_with_partners(order, partner, count)


def merge_step(
    x: Tensor, keys: Tensor, sizes: Tensor | None = None, energy: Tensor | None = None, owner: Tensor | None = None,
    positions: Tensor | None = None, *, num_prefix: int, r: int, rule: str = "tome", guard: float = 0.0,
    margin: float = 0.0, alpha: float = 1.0, check_finite: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One merge of ToMe's loop (ranking and applying) in one call: ``(x', sizes', energy', owner', positions')``.

    x [B,K,D] (the first ``num_prefix`` tokens never merge), keys [B,H,K,hd] of x's dtype (their
    head mean, normalised, is the metric), sizes [B,K] of x's dtype (None: all 1), energy [B,K]
    (x's dtype in float32/float64, else float32; None: none carried), owner [B,N] int64 (the current
    index of each original token; None: the identity), positions [B,K] int64 (the original place of
    each current token; None: the identity). ``rule`` ranks the ``R`` merges (``r`` clipped):

    - ``"tome"``: ToMe's split ``[prefix, A (even positions), B (odd)]``, each A token's most similar
      B token, the ``R = min(r, |A|)`` most similar pairs (0 when B is empty);
    - ``"cosine"`` / ``"bound"`` (energy required): importance_tome's guarded cost (ToMe's split, the
      ``R`` cheapest pairs; ``guard`` the energies' exponent);
    - ``"pitome"`` / ``"pitome_protected"``: PiToMe's energy order (``margin``, ``alpha``), ``R =
      min(r, n // 2)`` of the n patch tokens, the protected form keeping all but the ``2R`` highest.

    Returns x' [B,K-R,D] (the merged sequence, each destination the size-weighted mean of itself and
    its sources), sizes' [B,K-R], energy' [B,K-R] (summed; an empty [0] without energy), owner' [B,N]
    (the new index of each original token) and positions' [B,K-R] (a merged token keeps its
    destination's). Ties are decided by position, exactly as the unfused path
    (``pullback_ext.prune.methods.merging``) decides them. Forward-only (no gradient).
    """
    _op_checks.merge_step(x, keys, sizes, energy, owner, positions, num_prefix, r, rule, finite=check_finite)
    args = (x, keys, sizes, energy, owner, positions, int(num_prefix), int(r), rule, float(guard), float(margin),
            float(alpha))
    return torch.ops.pullback_ext.merge_step(*args) if merge_step_compiled(x) else reference.merge_step(*args)


def agglomerate(dist: Tensor, sizes: Tensor | None = None, energy: Tensor | None = None, *, count: int,
                linkage: str = "average", check_values: bool = True, check_finite: bool = False) -> Tensor:
    """The greedy agglomerative clustering of ``n`` points into ``count`` clusters (ATC's and
    importance_cluster's): ``owner [B,n]`` int64, the smallest member of each point's cluster.

    dist [B,n,n] (symmetric; its diagonal is never a candidate pair where it is ``inf``, and with
    ``bound`` it is never read), ``min(1, n) <= count <= n``. Each of the ``n - count`` steps merges the
    two clusters ``(a, z)`` of the least linkage value, ``a < z`` their smallest members, the first
    minimum of the symmetric matrix in row-major order on ties, and computes the merged cluster's
    values to every other:

    - ``"average"`` (UPGMA): the mean of the member distances; ``"single"`` the least, ``"complete"``
      the largest (dist: the points' distances, ``inf`` on the diagonal, as ATC's);
    - ``"bound"``: importance_cluster's cost ``(E_a S_b² + E_b S_a²) / (S_a + S_b)² · ‖k_a - k_b‖²``
      from sizes and energy [B,n] (dist's dtype; sums over a cluster's points) and dist the squared
      distances of the points ``‖k_i - k_j‖²``; a cluster's centre ``k`` is the size-weighted mean of
      its points', its squared distances follow by Lance–Williams for centroids (clamped at 0).

    The compiled kernels (float32/float64; CPU one image per task, CUDA one block per image) keep the
    least entry of each row and rescan only the rows a merge touched: O(n²) per image where the
    reference's loop of tensor ops is O(n³) and ``n - count`` dispatches of a dozen ops. They round every
    value as the reference does and take its decisions bit for bit. ``check_values`` (dist symmetric,
    sizes > 0, energy >= 0) reads the data; the kernels stay memory-safe without it. Forward-only.
    """
    count = operator.index(count)
    _op_checks.agglomerate(dist, sizes, energy, count, linkage, values=check_values, finite=check_finite)
    if _HAS_AGGLOMERATE and uses_compiled(dist) and dist.dtype in _CPU_DTYPES:
        return torch.ops.pullback_ext.agglomerate(dist, sizes, energy, count, linkage)
    return reference.agglomerate(dist, sizes, energy, count, linkage)


# --- dispatcher registrations: fake (meta) kernels for torch.compile, autograd formulas ---------


def _register_fake_kernels() -> None:
    """Output metadata of every op for FakeTensor / torch.compile, after the same metadata checks as
    the eager front ends (so a bad shape fails while tracing too)."""

    def fake(name):
        return torch.library.register_fake(f"pullback_ext::{name}")

    @fake("lowrank_metric_apply")
    def _(U, lam, v, eps):
        _op_checks.lowrank_metric(U, lam, v, eps)
        return v.new_empty(v.shape)

    @fake("lowrank_metric_quadform")
    def _(U, lam, v, eps):
        _op_checks.lowrank_metric(U, lam, v, eps)
        return v.new_empty((v.shape[0], v.shape[2]))

    @fake("token_importance")
    def _(U, lam, num_tokens):
        _op_checks.token_importance(U, lam, num_tokens)
        return U.new_empty((U.shape[0], num_tokens))

    @fake("block_orthonormalize")
    def _(X):
        _op_checks.block_orthonormalize(X)
        return X.new_empty(X.shape), X.new_empty((X.shape[0], X.shape[2], X.shape[2]))

    @fake("gather_tokens")
    def _(x, idx):
        _op_checks.gather_tokens(x, idx)
        return x.new_empty((x.shape[0], idx.shape[1], x.shape[2]))

    @fake("merge_tokens")
    def _(x, w, src_idx, dst_idx):
        _op_checks.merge_tokens(x, w, src_idx, dst_idx)
        kept = x.shape[1] - src_idx.shape[1]
        return x.new_empty((x.shape[0], kept, x.shape[2])), w.new_empty((w.shape[0], kept))

    @fake("reinsert_tokens")
    def _(kept, kept_idx, pruned, pruned_idx):
        _op_checks.reinsert_tokens(kept, kept_idx, pruned, pruned_idx)
        return kept.new_empty((kept.shape[0], kept.shape[1] + pruned.shape[1], kept.shape[2]))

    @(fake("merge_step") if _HAS_MERGE_STEP else (lambda f: f))
    def _(x, keys, sizes, energy, owner, positions, num_prefix, r, rule, guard, margin, alpha):
        _op_checks.merge_step(x, keys, sizes, energy, owner, positions, num_prefix, r, rule)
        b, k, d = x.shape
        kept = k - reference.merge_step_count(rule, r, num_prefix, k)
        n = k if owner is None else owner.shape[1]
        return (x.new_empty((b, kept, d)), x.new_empty((b, kept)),
                x.new_empty(0) if energy is None else energy.new_empty((b, kept)),
                x.new_empty((b, n), dtype=torch.int64), x.new_empty((b, kept), dtype=torch.int64))

    @fake("select_with_partners")
    def _(order, partner, count):
        _op_checks.select_with_partners(order, partner, count)
        return order.new_empty((order.shape[0], count))

    @(fake("agglomerate") if _HAS_AGGLOMERATE else (lambda f: f))
    def _(dist, sizes, energy, count, linkage):
        _op_checks.agglomerate(dist, sizes, energy, count, linkage)
        return dist.new_empty(dist.shape[:2], dtype=torch.int64)


def _register_flop_formula() -> None:
    """merge_step's FLOPs for ``torch.utils.flop_counter``: the similarity matmuls the unfused step
    counts (``2 B |A| |B| hd``, and PiToMe's ``2 B n² hd`` of its energies), so that a FLOP ratio
    is the same whichever path ran."""
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.pullback_ext.merge_step)
    def _(x_shape, keys_shape, sizes, energy, owner, positions, num_prefix, r, rule, *args, out_shape=None, **kwargs):
        b, k, hd, p = x_shape[0], x_shape[1], keys_shape[3], num_prefix
        count, n = reference.merge_step_count(rule, r, p, k), k - p
        if count == 0:
            return 0
        if rule.startswith("pitome"):
            candidates = 2 * count if rule == "pitome_protected" else n
            return 2 * b * hd * ((candidates + 1) // 2 * (candidates // 2) + n * n)
        size_a = (k + 1) // 2 - (p + 1) // 2
        return 2 * b * hd * size_a * (n - size_a)


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*(t for t in inputs if isinstance(t, Tensor)))
    ctx.scalars = [a for a in inputs if not isinstance(a, Tensor)]


def _apply_backward(ctx, grad: Tensor):
    U, lam, v = ctx.saved_tensors
    eps = ctx.scalars[0]
    need_U, need_lam, need_v = ctx.needs_input_grad[:3]
    grad_U = grad_lam = grad_v = None
    if need_v:
        # g is symmetric: the vector-Jacobian product is the op applied to the incoming grad.
        grad_v = torch.ops.pullback_ext.lowrank_metric_apply(U, lam, grad, eps)
    if need_U or need_lam:
        proj_v = U.transpose(1, 2) @ v  # [B,r,k]
        proj_g = U.transpose(1, 2) @ grad
        if need_U:
            grad_U = grad @ (lam.unsqueeze(-1) * proj_v).transpose(1, 2) + v @ (lam.unsqueeze(-1) * proj_g).transpose(1, 2)
        if need_lam:
            grad_lam = (proj_v * proj_g).sum(-1)
    return grad_U, grad_lam, grad_v, None


def _quadform_backward(ctx, grad: Tensor):
    U, lam, v = ctx.saved_tensors
    eps = ctx.scalars[0]
    need_U, need_lam, need_v = ctx.needs_input_grad[:3]
    grad_U = grad_lam = grad_v = None
    g = grad.unsqueeze(1)  # [B,1,k]
    if need_v:
        grad_v = 2 * g * torch.ops.pullback_ext.lowrank_metric_apply(U, lam, v, eps)
    if need_U or need_lam:
        proj = U.transpose(1, 2) @ v  # [B,r,k]
        if need_U:
            grad_U = 2 * v @ (lam.unsqueeze(-1) * proj * g).transpose(1, 2)
        if need_lam:
            grad_lam = (proj * proj * g).sum(-1)
    return grad_U, grad_lam, grad_v, None


def _importance_setup(ctx, inputs, output) -> None:
    U, lam, num_tokens = inputs
    ctx.save_for_backward(U, lam, output)
    ctx.num_tokens = num_tokens


def _importance_backward(ctx, grad: Tensor):
    U, lam, imp = ctx.saved_tensors
    B, P, r = U.shape
    N = ctx.num_tokens
    # d imp_t / d s_t = 1 / (2 imp_t) with s_t = Σ_j lam_j ‖u_j^(t)‖²; taken as 0 where imp_t = 0.
    half_rate = torch.where(imp > 0, grad / torch.where(imp > 0, imp, 1), 0) / 2  # [B,N]
    grad_U = grad_lam = None
    if ctx.needs_input_grad[0]:
        scale = half_rate.repeat_interleave(P // N, dim=1).unsqueeze(-1)  # [B,P,1]
        grad_U = 2 * scale * lam.unsqueeze(1) * U
    if ctx.needs_input_grad[1]:
        energy = (U * U).reshape(B, N, P // N, r).sum(2)  # [B,N,r]
        grad_lam = (energy * half_rate.unsqueeze(-1)).sum(1)
    return grad_U, grad_lam, None


def _qr_setup(ctx, inputs, output) -> None:
    pass


def _qr_backward(ctx, grad_Q: Tensor, grad_R: Tensor):
    raise RuntimeError("block_orthonormalize is forward-only: it has no backward formula")


def _merge_step_backward(ctx, *grads):
    raise RuntimeError("merge_step is forward-only: it has no backward formula (the methods run the unfused merge "
                       "where a gradient is needed)")


def _gather_backward(ctx, grad: Tensor):
    x, idx = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        index = idx.unsqueeze(-1).expand(-1, -1, x.shape[-1])
        grad_x = torch.zeros_like(x).scatter_add(1, index, grad)
    return grad_x, None


def _merge_setup(ctx, inputs, output) -> None:
    x, w, src_idx, dst_idx = inputs
    if not ctx.needs_input_grad[1]:
        # w' = w_d + Σ w_s depends on w alone: without a gradient into w it has none, whatever x needs.
        # (Marked differentiable, the merged sizes of ToMe's loop required grad whenever the tokens did,
        # which turns the log-size attention mask into one that needs grad: the CPU's fused attention
        # refuses such a mask and the math path returns another layout, so a trace made where the
        # mask needed no grad (torch.export) failed to re-run where it did (ONNX's type promotion).)
        ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, w, src_idx, dst_idx, *output)


def _merge_backward(ctx, grad_x_out: Tensor | None, grad_w_out: Tensor | None):
    x, w, src_idx, dst_idx, x_out, w_out = ctx.saved_tensors
    B, N, D = x.shape
    if grad_x_out is None:
        grad_x_out = torch.zeros_like(x_out)
    if grad_w_out is None:
        grad_w_out = torch.zeros_like(w_out)
    # slot[b, t]: the output slot token t ends up in (its own slot, or that of its dst token).
    kept = torch.ones(B, N, dtype=torch.bool, device=x.device).scatter(1, src_idx, False)
    kept_slot = kept.long().cumsum(1) - 1
    dest = torch.arange(N, device=x.device).expand(B, N).scatter(1, src_idx, dst_idx)
    slot = kept_slot.gather(1, dest)
    total = w_out.gather(1, slot)  # [B,N] weight of the group token t belongs to
    merged = x_out.gather(1, slot.unsqueeze(-1).expand(-1, -1, D))
    g_merged = grad_x_out.gather(1, slot.unsqueeze(-1).expand(-1, -1, D))
    positive = total > 0
    safe_total = torch.where(positive, total, 1).unsqueeze(-1)
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        # A zero-weight group leaves its dst token unchanged and ignores its sources.
        unchanged = torch.where(kept.unsqueeze(-1), g_merged, 0)
        grad_x = torch.where(positive.unsqueeze(-1), w.unsqueeze(-1) * g_merged / safe_total, unchanged)
    if ctx.needs_input_grad[1]:
        through_x = torch.where(positive, (g_merged * (x - merged) / safe_total).sum(-1), 0)
        grad_w = through_x + grad_w_out.gather(1, slot)
    return grad_x, grad_w, None, None


def _reinsert_setup(ctx, inputs, output) -> None:
    kept, kept_idx, pruned, pruned_idx = inputs
    ctx.save_for_backward(kept_idx, pruned_idx)


def _reinsert_backward(ctx, grad: Tensor):
    kept_idx, pruned_idx = ctx.saved_tensors
    gather = torch.ops.pullback_ext.gather_tokens
    grad_kept = gather(grad, kept_idx) if ctx.needs_input_grad[0] else None
    grad_pruned = gather(grad, pruned_idx) if ctx.needs_input_grad[2] else None
    return grad_kept, None, grad_pruned, None


def _register_autograd() -> None:
    reg = torch.library.register_autograd
    reg("pullback_ext::lowrank_metric_apply", _apply_backward, setup_context=_save_inputs)
    reg("pullback_ext::lowrank_metric_quadform", _quadform_backward, setup_context=_save_inputs)
    reg("pullback_ext::token_importance", _importance_backward, setup_context=_importance_setup)
    reg("pullback_ext::block_orthonormalize", _qr_backward, setup_context=_qr_setup)
    reg("pullback_ext::gather_tokens", _gather_backward, setup_context=_save_inputs)
    reg("pullback_ext::merge_tokens", _merge_backward, setup_context=_merge_setup)
    reg("pullback_ext::reinsert_tokens", _reinsert_backward, setup_context=_reinsert_setup)
    if _HAS_MERGE_STEP:
        reg("pullback_ext::merge_step", _merge_step_backward, setup_context=_qr_setup)
        _register_flop_formula()


if _C is not None:
    _register_fake_kernels()
    _register_autograd()
