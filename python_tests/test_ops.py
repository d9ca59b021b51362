"""The compiled ops (pullback_ext.ops) against the pure-torch reference, autograd, opcheck, compile."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.ops import DEVICES, TOLERANCE, compiled_dtypes, merge_inputs, metric_inputs, reinsert_inputs
from pullback_ext import ops, reference

# (B, N, D, r, k): odd sizes, B = 1, k = 1, r = 1, r = P.
METRIC_SHAPES = [(1, 3, 5, 1, 1), (2, 7, 3, 4, 1), (3, 5, 9, 6, 3), (1, 1, 4, 4, 2), (2, 11, 16, 20, 20), (1, 5, 13, 7, 53)]


def _close(actual, expected, dtype):
    """Elementwise closeness, with the absolute tolerance scaled by the size of the result."""
    tol = TOLERANCE[dtype]
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double().cpu(), expected.double(), rtol=tol["rtol"], atol=tol["atol"] * scale)


def _reference64(fn, *args):
    """The reference evaluated in float64 on the CPU: the oracle for every dtype and device."""
    cast = [a.detach().cpu().double() if isinstance(a, torch.Tensor) and a.is_floating_point() else
            (a.cpu() if isinstance(a, torch.Tensor) else a) for a in args]
    return fn(*cast)


def _params(device):
    return [(device, dt) for dt in compiled_dtypes(device)]


@pytest.fixture(params=[pytest.param(p, id=f"{p[0]}-{str(p[1])[6:]}") for d in ("cpu", "cuda") for p in _params(d)])
def device_dtype(request):
    device, dtype = request.param
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return device, dtype


def test_compiled_op_is_used_for_cpu_float32():
    U, lam, v = metric_inputs(1, 3, 4, 2, 1, torch.float32, "cpu")
    assert ops.uses_compiled(U), "the compiled extension is not loaded: build it with setup.py build_ext --inplace"
    with torch.autograd.profiler.profile() as prof:
        ops.lowrank_metric_apply(U, lam, v, 0.1)
    names = [e.name for e in prof.function_events]
    assert names.count("pullback_ext::lowrank_metric_apply") == 1  # dispatched once, to the CPU kernel
    assert not ops.uses_compiled(U.half())


@pytest.mark.parametrize("shape", METRIC_SHAPES)
def test_metric_ops_match_reference(shape, device_dtype):
    device, dtype = device_dtype
    B, N, D, r, k = shape
    U, lam, v = metric_inputs(B, N, D, r, k, dtype, device)
    eps = 0.37
    _close(ops.lowrank_metric_apply(U, lam, v, eps), _reference64(reference.lowrank_metric_apply, U, lam, v, eps), dtype)
    _close(ops.lowrank_metric_quadform(U, lam, v, eps), _reference64(reference.lowrank_metric_quadform, U, lam, v, eps), dtype)
    _close(ops.token_importance(U, lam, N), _reference64(reference.token_importance, U, lam, N), dtype)


def test_metric_ops_span_several_row_blocks():
    # P above the kernels' row block (2048 / 4096 rows) and not a multiple of it.
    U, lam, v = metric_inputs(2, 5, 1001, 3, 2, torch.float32, "cpu")
    _close(ops.lowrank_metric_apply(U, lam, v, 0.5), _reference64(reference.lowrank_metric_apply, U, lam, v, 0.5), torch.float32)
    _close(ops.lowrank_metric_quadform(U, lam, v, 0.5), _reference64(reference.lowrank_metric_quadform, U, lam, v, 0.5), torch.float32)
    _close(ops.token_importance(U, lam, 5), _reference64(reference.token_importance, U, lam, 5), torch.float32)


def test_metric_closed_form():
    # U with orthonormal columns: g has eigenvalues eps + lam_j on span(U) and eps off it.
    U = torch.linalg.qr(torch.randn(1, 12, 3, dtype=torch.float64)).Q
    lam = torch.tensor([[2.0, 0.5, 0.0]], dtype=torch.float64)
    v = torch.cat([U, torch.eye(12, dtype=torch.float64)[None, :, :1] - U @ (U.mT @ torch.eye(12, dtype=torch.float64)[None, :, :1])], -1)
    y = ops.lowrank_metric_apply(U, lam, v, 0.25)
    torch.testing.assert_close(y[..., :3], U * (0.25 + lam[:, None, :]))
    torch.testing.assert_close(y[..., 3], 0.25 * v[..., 3])
    q = ops.lowrank_metric_quadform(U, lam, v[..., :3], 0.25)
    torch.testing.assert_close(q, 0.25 + lam)


def test_paper_sized_cpu_operands_match_reference():
    # Paper-sized operands: many row blocks and parallel tasks per image, tens of MB of output.
    B, N, D, R = 24, 257, 768, 64
    x, w, src, dst = merge_inputs(B, N, D, R, torch.float32, "cpu")
    x_new, w_new = ops.merge_tokens(x, w, src, dst)
    x_ref, w_ref = _reference64(reference.merge_tokens, x, w, src, dst)
    _close(x_new, x_ref, torch.float32)
    _close(w_new, w_ref, torch.float32)
    kept_idx = torch.stack([torch.randperm(N)[: N - R] for _ in range(B)])
    assert torch.equal(ops.gather_tokens(x, kept_idx), reference.gather_tokens(x, kept_idx))
    kept, kept_idx, pruned, pruned_idx = reinsert_inputs(B, N - R, R, D, torch.float32, "cpu")
    assert torch.equal(ops.reinsert_tokens(kept, kept_idx, pruned, pruned_idx),
                       reference.reinsert_tokens(kept, kept_idx, pruned, pruned_idx))
    U, lam, v = metric_inputs(2, 257, 768, 20, 12, torch.float32, "cpu")
    _close(ops.lowrank_metric_apply(U, lam, v, 0.3), _reference64(reference.lowrank_metric_apply, U, lam, v, 0.3), torch.float32)
    X = torch.randn(2, 257 * 768, 20, generator=torch.Generator().manual_seed(0))
    Q, R_ = ops.block_orthonormalize(X, return_r=True)
    eye = torch.eye(20, dtype=torch.float64)
    assert float((Q.double().mT @ Q.double() - eye).abs().max()) <= 1e-5
    assert float((Q.double() @ R_.double() - X.double()).abs().max()) <= 1e-4


@pytest.mark.parametrize("B,N,D,R", [(1, 2, 1, 1), (2, 9, 5, 4), (3, 17, 33, 8), (1, 6, 3, 0)])
def test_token_ops_match_reference(B, N, D, R, device_dtype):
    device, dtype = device_dtype
    x, w, src, dst = merge_inputs(B, N, D, R, dtype, device)
    x_new, w_new = ops.merge_tokens(x, w, src, dst)
    x_ref, w_ref = _reference64(reference.merge_tokens, x, w, src, dst)
    _close(x_new, x_ref, dtype)
    _close(w_new, w_ref, dtype)
    idx = torch.randint(0, N, (B, N + 3), device=device)
    assert torch.equal(ops.gather_tokens(x, idx).cpu(), reference.gather_tokens(x.cpu(), idx.cpu()))
    kept, kept_idx, pruned, pruned_idx = reinsert_inputs(B, N - R, R, D, dtype, device)
    out = ops.reinsert_tokens(kept, kept_idx, pruned, pruned_idx)
    assert torch.equal(out.cpu(), reference.reinsert_tokens(kept.cpu(), kept_idx.cpu(), pruned.cpu(), pruned_idx.cpu()))


def test_merge_closed_form():
    x = torch.tensor([[[1.0, 0.0], [3.0, 4.0], [5.0, 8.0], [7.0, 1.0]]])
    w = torch.tensor([[1.0, 2.0, 0.0, 3.0]])
    # token 0 -> 1, token 2 -> 3 (zero weight: 3 unchanged, weight unchanged)
    x_new, w_new = ops.merge_tokens(x, w, torch.tensor([[0, 2]]), torch.tensor([[1, 3]]))
    torch.testing.assert_close(x_new, torch.tensor([[[7.0 / 3.0, 8.0 / 3.0], [7.0, 1.0]]]))
    torch.testing.assert_close(w_new, torch.tensor([[3.0, 3.0]]))
    # all weights of a group zero: the dst token stays as it was
    x_new, w_new = ops.merge_tokens(x, torch.zeros(1, 4), torch.tensor([[0]]), torch.tensor([[1]]))
    torch.testing.assert_close(x_new, x[:, 1:])
    torch.testing.assert_close(w_new, torch.zeros(1, 3))


def test_non_contiguous_inputs_are_handled():
    U, lam, v = metric_inputs(3, 4, 5, 3, 2, torch.float64, "cpu")
    Ut = U.transpose(0, 1).contiguous().transpose(0, 1)
    vt = v[..., [1, 0]]
    lam_t = lam.t().contiguous().t()
    assert not Ut.is_contiguous() and not lam_t.is_contiguous()
    _close(ops.lowrank_metric_apply(Ut, lam_t, vt, 0.1), reference.lowrank_metric_apply(U, lam, vt.contiguous(), 0.1), torch.float64)
    x, w, src, dst = merge_inputs(2, 8, 6, 3, torch.float64, "cpu")
    xs = x[:, :, ::2]
    idx = torch.stack([src[:, 0], dst[:, 0]], 0).t()[:, :1].expand(2, 3)
    assert not xs.is_contiguous() and not idx.is_contiguous()
    assert torch.equal(ops.gather_tokens(xs, idx), reference.gather_tokens(xs, idx))


def test_cpu_half_falls_back_to_reference():
    U, lam, v = metric_inputs(2, 3, 4, 2, 1, torch.float16, "cpu")
    y = ops.lowrank_metric_apply(U, lam, v, 0.5)
    assert y.dtype == torch.float16
    _close(y, _reference64(reference.lowrank_metric_apply, U, lam, v, 0.5), torch.float16)


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3), N=st.integers(1, 6), D=st.integers(1, 7), r=st.integers(1, 5), k=st.integers(1, 4),
    eps=st.floats(0, 10), scale=st.sampled_from([1e-3, 1.0, 1e3]), seed=st.integers(0, 2**16),
)
def test_fuzz_metric_ops(B, N, D, r, k, eps, scale, seed):
    r = min(r, N * D)
    U, lam, v = metric_inputs(B, N, D, r, k, torch.float64, "cpu", seed)
    U = U * scale
    torch.testing.assert_close(ops.lowrank_metric_apply(U, lam, v, eps), reference.lowrank_metric_apply(U, lam, v, eps))
    torch.testing.assert_close(ops.lowrank_metric_quadform(U, lam, v, eps), reference.lowrank_metric_quadform(U, lam, v, eps))
    torch.testing.assert_close(ops.token_importance(U, lam, N), reference.token_importance(U, lam, N))


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 3), N=st.integers(2, 12), D=st.integers(1, 6), frac=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_fuzz_token_ops(B, N, D, frac, seed):
    R = min(N - 1, int(frac * N))
    x, w, src, dst = merge_inputs(B, N, D, R, torch.float64, "cpu", seed)
    for a, b in zip(ops.merge_tokens(x, w, src, dst), reference.merge_tokens(x, w, src, dst)):
        torch.testing.assert_close(a, b)
    kept, kept_idx, pruned, pruned_idx = reinsert_inputs(B, N - R, R, D, torch.float64, "cpu", seed)
    assert torch.equal(ops.reinsert_tokens(kept, kept_idx, pruned, pruned_idx),
                       reference.reinsert_tokens(kept, kept_idx, pruned, pruned_idx))


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device):
    U, lam, v = metric_inputs(2, 3, 2, 2, 2, torch.float64, device)
    U, lam, v = (t.requires_grad_() for t in (U, lam, v))
    assert torch.autograd.gradcheck(lambda a, b, c: ops.lowrank_metric_apply(a, b, c, 0.3), (U, lam, v))
    assert torch.autograd.gradcheck(lambda a, b, c: ops.lowrank_metric_quadform(a, b, c, 0.3), (U, lam, v))
    assert torch.autograd.gradcheck(lambda a, b: ops.token_importance(a, b, 3), (U, lam))
    x, w, src, dst = merge_inputs(2, 7, 3, 3, torch.float64, device)
    x, w = x.requires_grad_(), w.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: ops.merge_tokens(a, b, src, dst), (x, w))
    idx = torch.tensor([[0, 0, 5], [6, 1, 1]], device=device)
    assert torch.autograd.gradcheck(lambda a: ops.gather_tokens(a, idx), (x,))
    kept, kept_idx, pruned, pruned_idx = reinsert_inputs(2, 4, 3, 2, torch.float64, device)
    kept, pruned = kept.requires_grad_(), pruned.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: ops.reinsert_tokens(a, kept_idx, b, pruned_idx), (kept, pruned))


def test_merge_gradient_with_a_zero_weight_group():
    x, w, src, dst = merge_inputs(1, 5, 2, 2, torch.float64, "cpu")
    w = w.clone()
    w[0, src[0, 0]] = 0
    w[0, dst[0, 0]] = 0
    if dst[0, 1] == dst[0, 0]:
        w[0, src[0, 1]] = 0
    x.requires_grad_()
    out, _ = ops.merge_tokens(x, w, src, dst)
    ref_out, _ = reference.merge_tokens(x, w, src, dst)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    (gx_ref,) = torch.autograd.grad(ref_out, x, g)
    torch.testing.assert_close(gx, gx_ref)


def test_qr_refuses_gradients():
    X = torch.randn(1, 6, 2, requires_grad=True)
    with pytest.raises(RuntimeError, match="forward-only"):
        ops.block_orthonormalize(X)
    Q, R = torch.ops.pullback_ext.block_orthonormalize(X)
    with pytest.raises(RuntimeError, match="forward-only"):
        Q.sum().backward()
    with torch.no_grad():
        assert ops.block_orthonormalize(X).shape == (1, 6, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    opcheck = torch.library.opcheck
    U, lam, v = metric_inputs(2, 3, 2, 2, 2, torch.float64, device)
    grad = lambda *ts: [t.clone().requires_grad_() for t in ts]  # noqa: E731
    opcheck(torch.ops.pullback_ext.lowrank_metric_apply.default, (*grad(U, lam, v), 0.3))
    opcheck(torch.ops.pullback_ext.lowrank_metric_quadform.default, (*grad(U, lam, v), 0.3))
    opcheck(torch.ops.pullback_ext.token_importance.default, (*grad(U, lam), 3))
    opcheck(torch.ops.pullback_ext.block_orthonormalize.default, (U,))
    x, w, src, dst = merge_inputs(2, 7, 3, 3, torch.float64, device)
    opcheck(torch.ops.pullback_ext.merge_tokens.default, (*grad(x, w), src, dst))
    opcheck(torch.ops.pullback_ext.gather_tokens.default, (*grad(x), src))
    kept, kept_idx, pruned, pruned_idx = reinsert_inputs(2, 4, 3, 2, torch.float64, device)
    opcheck(torch.ops.pullback_ext.reinsert_tokens.default, (grad(kept)[0], kept_idx, grad(pruned)[0], pruned_idx))


def _every_op(U, lam, v, x, w, src, dst, kept, kept_idx, pruned, pruned_idx, check_values=False):
    """A scalar from every op: the metric ops on (U, lam, v), the token ops on the rest."""
    checks = dict(check_values=check_values)
    y = ops.lowrank_metric_apply(U, lam, v, 0.1, **checks)
    q = ops.lowrank_metric_quadform(U, lam, y, 0.1, **checks)
    imp = ops.token_importance(U, lam, 4, **checks)
    Q = ops.block_orthonormalize(U.detach())
    x_new, w_new = ops.merge_tokens(x, w, src, dst, **checks)
    gathered = ops.gather_tokens(x, kept_idx, **checks)
    back = ops.reinsert_tokens(kept, kept_idx, pruned, pruned_idx, **checks)
    return y.sum() + q.sum() + imp.sum() + Q.sum() + x_new.sum() + w_new.sum() + gathered.sum() + back.sum()


def _every_op_inputs():
    U, lam, v = metric_inputs(2, 4, 3, 2, 1, torch.float32, "cpu")
    x, w, src, dst = merge_inputs(2, 6, 3, 2, torch.float32, "cpu")
    kept, kept_idx, pruned, pruned_idx = reinsert_inputs(2, 4, 2, 3, torch.float32, "cpu")
    return [U.requires_grad_(), lam, v, x, w, src, dst, kept, kept_idx, pruned, pruned_idx]


def test_torch_compile_fullgraph_of_unchecked_calls():
    """check_values=False leaves nothing in the ops that dynamo cannot trace: no graph break, and
    the compiled function (forward and backward) equals eager."""
    torch._dynamo.reset()
    inputs = _every_op_inputs()
    assert torch._dynamo.explain(_every_op)(*inputs).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(_every_op, fullgraph=True, backend="aot_eager")
    out = compiled(*inputs)
    expected = _every_op(*inputs)
    torch.testing.assert_close(out, expected)
    (g,) = torch.autograd.grad(out, inputs[0])
    (g_ref,) = torch.autograd.grad(expected, inputs[0])
    torch.testing.assert_close(g, g_ref)


def test_torch_compile_keeps_the_value_checks_of_checked_calls():
    torch._dynamo.reset()
    inputs = _every_op_inputs()
    compiled = torch.compile(lambda *a: _every_op(*a, check_values=True), backend="aot_eager")
    torch.testing.assert_close(compiled(*inputs), _every_op(*inputs))
    inputs[6] = inputs[5].clone()  # dst_idx = src_idx: every destination is merged away
    with pytest.raises(ValueError, match="dst_idx must point at tokens that are kept"):
        compiled(*inputs)


def test_build_mismatch_raises(monkeypatch):
    from pullback_ext import _loader

    fake = types.ModuleType("pullback_ext._build_info")
    fake.TORCH_VERSION, fake.CUDA_VERSION, fake.WITH_CUDA, fake.CUDA_ARCHS = "1.0.0", None, False, ""
    monkeypatch.setitem(sys.modules, "pullback_ext._build_info", fake)
    _loader.load_compiled.cache_clear()
    try:
        with pytest.raises(_loader.BuildMismatchError, match="built against torch 1.0.0"):
            _loader.load_compiled()
    finally:
        monkeypatch.undo()
        _loader.load_compiled.cache_clear()
        assert importlib.import_module("pullback_ext._loader").load_compiled() is not None


OP_NAMES = ["lowrank_metric_apply", "lowrank_metric_quadform", "token_importance", "block_orthonormalize",
            "gather_tokens", "merge_tokens", "reinsert_tokens", "select_with_partners", "agglomerate"]


def test_ops_have_one_kernel_per_device_and_no_pybind_surface():
    from pullback_ext import _C

    with_cuda = bool(importlib.import_module("pullback_ext._build_info").WITH_CUDA)
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in OP_NAMES:
        qualified = f"pullback_ext::{name}"
        assert has_kernel(qualified, "CPU") and has_kernel(qualified, "Meta")
        assert has_kernel(qualified, "CUDA") == with_cuda
        assert not has_kernel(qualified, "CompositeImplicitAutograd")
        assert not has_kernel(qualified, "CompositeExplicitAutograd")
        assert not hasattr(_C, name), f"_C.{name}: the ops' Python surface is pullback_ext.ops"
        assert "check" not in str(getattr(torch.ops.pullback_ext, name).default._schema)
    assert _C.cuda_available() == with_cuda
    assert _C.cpu_isa() in ("baseline", "avx2", "avx512")


def test_direct_op_calls_keep_the_memory_invariants():
    """torch.ops.pullback_ext.* skip the validation of pullback_ext.ops; the kernels still refuse
    metadata they would address memory out of bounds with."""
    pe = torch.ops.pullback_ext
    U, lam, v = metric_inputs(2, 3, 4, 2, 2, torch.float64, "cpu")
    x, w, src, dst = merge_inputs(2, 6, 3, 2, torch.float64, "cpu")
    kept, kept_idx, pruned, pruned_idx = reinsert_inputs(2, 4, 2, 3, torch.float64, "cpu")
    calls = {
        "lowrank_metric_apply": lambda: pe.lowrank_metric_apply(U, lam[:, :1], v, 0.1),
        "lowrank_metric_quadform": lambda: pe.lowrank_metric_quadform(U, lam, v[:, :5], 0.1),
        "token_importance": lambda: pe.token_importance(U, lam, 5),
        "block_orthonormalize": lambda: pe.block_orthonormalize(U.mT),
        "gather_tokens": lambda: pe.gather_tokens(x, src.int()),
        "merge_tokens": lambda: pe.merge_tokens(x, w[:, :5], src, dst),
        "reinsert_tokens": lambda: pe.reinsert_tokens(kept, kept_idx, pruned, pruned_idx[:1]),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"pullback_ext::{name}: internal invariant violated"):
            call()


def test_unchecked_cpu_kernels_stay_memory_safe():
    """With check_values=False the CPU kernels read no index outside its tensor: valid inputs give
    the checked results, invalid ones unspecified values (a gathered row out of range is NaN)."""
    x, w, src, dst = merge_inputs(3, 40, 24, 12, torch.float32, "cpu")
    kept, kept_idx, pruned, pruned_idx = reinsert_inputs(3, 28, 12, 24, torch.float32, "cpu")

    def run_all(src, dst, kept_idx, pruned_idx, check_values):
        return (ops.gather_tokens(x, kept_idx, check_values=check_values),
                *ops.merge_tokens(x, w, src, dst, check_values=check_values),
                ops.reinsert_tokens(kept, kept_idx, pruned, pruned_idx, check_values=check_values))

    checked = run_all(src, dst, kept_idx, pruned_idx, True)
    for a, b in zip(checked, run_all(src, dst, kept_idx, pruned_idx, False)):
        assert torch.equal(a, b)
    bad_kept, bad_src, bad_dst, bad_pruned = kept_idx.clone(), src.clone(), dst.clone(), pruned_idx.clone()
    bad_kept[0, 0], bad_kept[1, 3] = 40 + 7, -3
    bad_src[0, 1] = bad_src[0, 0]  # repeated source
    bad_src[1, 0] = 10**9  # out of range
    bad_dst[2, 0] = bad_src[2, 1]  # destination merged away
    bad_dst[2, 2] = -1
    bad_pruned[0, 0] = 10**6
    out = run_all(bad_src, bad_dst, bad_kept, bad_pruned, False)
    assert torch.isnan(out[0][0, 0]).all() and torch.isnan(out[0][1, 3]).all()
    assert torch.equal(out[0][2], checked[0][2])
    assert out[1].shape == (3, 28, 24) and out[2].shape == (3, 28) and out[3].shape == (3, 40, 24)
    assert torch.isfinite(out[1]).all()  # unspecified, but every value comes from x and w


@pytest.mark.parametrize("N,D,r", [(3, 50, 33), (2, 300, 520)])
def test_importance_wide_rank(N, D, r):
    # r that is no divisor of the kernel's vector period, and r beyond its on-stack accumulator.
    U, lam, _ = metric_inputs(2, N, D, r, 1, torch.float64, "cpu")
    torch.testing.assert_close(ops.token_importance(U, lam, N), reference.token_importance(U, lam, N))


def test_cpu_kernels_run_on_every_intra_op_thread():
    # at::parallel_for inside the extension must really fork: a build without the OpenMP flags
    # ATen needs would run every CPU kernel on one thread.
    from pullback_ext._loader import load_compiled

    compiled = load_compiled()
    if compiled is None:
        pytest.skip("the extension is not built")
    threads = torch.get_num_threads()
    assert compiled.parallel_threads(64) == threads
    torch.set_num_threads(1)
    try:
        assert compiled.parallel_threads(64) == 1
    finally:
        torch.set_num_threads(threads)
