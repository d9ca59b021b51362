"""Every bad input named in the ops' contract raises a clear Python exception, on both paths.

"compiled" runs CPU float32 through pullback_ext._C; "fallback" runs CPU float16 through the
pure-torch reference path of pullback_ext.ops.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers.ops import merge_inputs, metric_inputs, reinsert_inputs
from pullback_ext import ops

PATHS = {"compiled": torch.float32, "fallback": torch.float16}


@pytest.fixture(params=list(PATHS))
def dtype(request):
    dt = PATHS[request.param]
    assert ops.uses_compiled(torch.empty(0, dtype=dt)) == (request.param == "compiled")
    return dt


def _metric(dtype, B=2, N=3, D=4, r=2, k=2):
    return metric_inputs(B, N, D, r, k, dtype, "cpu")


METRIC_OPS = {
    "apply": lambda U, lam, v, eps=0.1, **kw: ops.lowrank_metric_apply(U, lam, v, eps, **kw),
    "quadform": lambda U, lam, v, eps=0.1, **kw: ops.lowrank_metric_quadform(U, lam, v, eps, **kw),
}


@pytest.mark.parametrize("op", list(METRIC_OPS))
def test_metric_bad_inputs(op, dtype):
    fn = METRIC_OPS[op]
    U, lam, v = _metric(dtype)
    with pytest.raises(ValueError, match=r"U must have 3 dimensions.*\[12, 2\]"):
        fn(U[0], lam, v)
    with pytest.raises(ValueError, match=r"lam must have shape \[B, r\] = \[2, 2\], got \[2, 3\]"):
        fn(U, torch.ones(2, 3, dtype=dtype), v)
    with pytest.raises(ValueError, match=r"v must have shape \[B, P, k\] = \[2, 12, \*\], got \[2, 11, 2\]"):
        fn(U, lam, v[:, :11])
    with pytest.raises(ValueError, match=r"v must hold k >= 1"):
        fn(U, lam, v[..., :0])
    with pytest.raises(TypeError, match=r"lam must have the dtype of U"):
        fn(U, lam.double(), v)
    with pytest.raises(TypeError, match=r"v must have the dtype of U"):
        fn(U, lam, v.double())
    with pytest.raises(TypeError, match=r"U must be (float32 or float64|a floating-point)"):
        fn(U.int(), lam, v)
    with pytest.raises(ValueError, match=r"r <= P.*r = 13.*P = 12|1 <= r <= P.*r = 13, P = 12"):
        fn(torch.ones(2, 12, 13, dtype=dtype), torch.ones(2, 13, dtype=dtype), v)
    with pytest.raises(ValueError, match=r"lam must be >= 0 everywhere, got a minimum of -0.5"):
        fn(U, lam - lam + torch.tensor([0.0, -0.5], dtype=dtype), v)
    with pytest.raises(ValueError, match=r"eps must be a finite value >= 0, got -0.1"):
        fn(U, lam, v, -0.1)
    with pytest.raises(ValueError, match=r"eps must be a finite value >= 0, got nan"):
        fn(U, lam, v, math.nan)
    with pytest.raises(ValueError, match=r"U has an empty batch"):
        fn(U[:0], lam[:0], v[:0])
    bad = v.clone()
    bad[1, 3, 0] = math.nan
    bad[0, 0, 1] = math.inf
    with pytest.raises(ValueError, match=r"v contains 2 NaN or infinite"):
        fn(U, lam, bad, check_finite=True)
    assert fn(U, lam, bad).shape[0] == 2  # the check is opt-in


def test_importance_bad_inputs(dtype):
    U, lam, _ = _metric(dtype)
    with pytest.raises(ValueError, match=r"num_tokens must .*divide P = 12.*num_tokens = 5|num_tokens = 5"):
        ops.token_importance(U, lam, 5)
    with pytest.raises(ValueError, match=r"num_tokens must be >= 1"):
        ops.token_importance(U, lam, 0)
    with pytest.raises(ValueError, match=r"lam must be >= 0"):
        ops.token_importance(U, -lam, 3)
    with pytest.raises(ValueError, match=r"U contains 1 NaN"):
        ops.token_importance(torch.where(U == U[0, 0, 0], math.nan, U), lam, 3, check_finite=True)


def test_qr_bad_inputs(dtype):
    with pytest.raises(ValueError, match=r"X must be tall.*r = 5.*P = 4|X must be tall.*\[1, 4, 5\]"):
        ops.block_orthonormalize(torch.ones(1, 4, 5, dtype=dtype))
    with pytest.raises(ValueError, match=r"X must have 3 dimensions"):
        ops.block_orthonormalize(torch.ones(4, 2, dtype=dtype))
    with pytest.raises(ValueError, match=r"X has an empty batch"):
        ops.block_orthonormalize(torch.ones(0, 4, 2, dtype=dtype))
    with pytest.raises(ValueError, match=r"X contains 1 NaN"):
        ops.block_orthonormalize(torch.tensor([[[1.0], [math.nan]]], dtype=dtype), check_finite=True)


def test_gather_bad_inputs(dtype):
    x = torch.randn(2, 5, 3, dtype=dtype)
    with pytest.raises(IndexError, match=r"idx\[1, 0\] = 5 is out of range: expected 0 <= index < 5"):
        ops.gather_tokens(x, torch.tensor([[0, 1], [5, 2]]))
    with pytest.raises(IndexError, match=r"idx\[0, 1\] = -1 is out of range"):
        ops.gather_tokens(x, torch.tensor([[0, -1], [1, 2]]))
    with pytest.raises(TypeError, match=r"idx must be an int64 index tensor, got .*[Ii]nt"):
        ops.gather_tokens(x, torch.tensor([[0, 1], [1, 2]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"idx must have shape \[B, K\] = \[2, \*\], got \[1, 2\]"):
        ops.gather_tokens(x, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"x has an empty batch"):
        ops.gather_tokens(x[:0], torch.zeros(0, 1, dtype=torch.long))


def test_merge_bad_inputs(dtype):
    x, w, src, dst = merge_inputs(2, 6, 3, 2, dtype, "cpu")
    with pytest.raises(ValueError, match=r"src_idx must not repeat a token"):
        ops.merge_tokens(x, w, torch.tensor([[0, 0], [1, 2]]), torch.tensor([[3, 3], [4, 4]]))
    with pytest.raises(ValueError, match=r"dst_idx must point at tokens that are kept: dst_idx\[1, 0\] = 2"):
        ops.merge_tokens(x, w, torch.tensor([[0, 1], [2, 3]]), torch.tensor([[4, 4], [2, 5]]))
    with pytest.raises(IndexError, match=r"src_idx\[0, 1\] = 6 is out of range"):
        ops.merge_tokens(x, w, torch.tensor([[0, 6], [1, 2]]), torch.tensor([[3, 3], [4, 4]]))
    with pytest.raises(IndexError, match=r"dst_idx\[1, 1\] = -2 is out of range"):
        ops.merge_tokens(x, w, torch.tensor([[0, 1], [1, 2]]), torch.tensor([[3, 3], [4, -2]]))
    with pytest.raises(ValueError, match=r"dst_idx must have shape \[B, R\].*got \[2, 1\]"):
        ops.merge_tokens(x, w, src, dst[:, :1])
    with pytest.raises(ValueError, match=r"w must have shape \[B, N\] = \[2, 6\], got \[2, 5\]"):
        ops.merge_tokens(x, w[:, :5], src, dst)
    with pytest.raises(ValueError, match=r"w must be >= 0 everywhere"):
        ops.merge_tokens(x, w - 10, src, dst)
    with pytest.raises(ValueError, match=r"fewer than N = 2 tokens per image, got R = 2"):
        ops.merge_tokens(x[:, :2], w[:, :2], torch.tensor([[0, 1], [1, 0]]), torch.tensor([[1, 0], [0, 1]]))
    with pytest.raises(TypeError, match=r"w must have the dtype of x"):
        ops.merge_tokens(x, w.double(), src, dst)
    with pytest.raises(ValueError, match=r"w contains 1 NaN"):
        ops.merge_tokens(x, torch.where(w == w[0, 0], math.nan, w), src, dst, check_finite=True)


def test_reinsert_bad_inputs(dtype):
    kept, kept_idx, pruned, pruned_idx = reinsert_inputs(2, 4, 2, 3, dtype, "cpu")
    dup = pruned_idx.clone()
    dup[1, 0] = kept_idx[1, 2]
    with pytest.raises(ValueError, match=r"must together cover 0..5 exactly once per image"):
        ops.reinsert_tokens(kept, kept_idx, pruned, dup)
    with pytest.raises(IndexError, match=r"pruned_idx\[0, 1\] = 6 is out of range: expected 0 <= index < 6"):
        ops.reinsert_tokens(kept, kept_idx, pruned, torch.tensor([[0, 6], [0, 1]]))
    with pytest.raises(ValueError, match=r"pruned must have shape \[B, R, D\].*got \[2, 2, 4\]"):
        ops.reinsert_tokens(kept, kept_idx, torch.zeros(2, 2, 4, dtype=dtype), pruned_idx)
    with pytest.raises(ValueError, match=r"kept_idx must have shape \[B, K\].*got \[2, 3\]"):
        ops.reinsert_tokens(kept, kept_idx[:, :3], pruned, pruned_idx)
    with pytest.raises(ValueError, match=r"kept has an empty batch"):
        ops.reinsert_tokens(kept[:0], kept_idx[:0], pruned[:0], pruned_idx[:0])
    with pytest.raises(TypeError, match=r"pruned must have the dtype of kept"):
        ops.reinsert_tokens(kept, kept_idx, pruned.double(), pruned_idx)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch():
    U, lam, v = _metric(torch.float32)
    with pytest.raises(ValueError, match=r"lam must be on the device of U"):
        ops.lowrank_metric_apply(U.cuda(), lam, v.cuda(), 0.1)
    x = torch.randn(2, 5, 3, device="cuda")
    with pytest.raises(ValueError, match=r"idx must be on the device of x"):
        ops.gather_tokens(x, torch.zeros(2, 1, dtype=torch.long))


def test_check_values_false_skips_only_the_value_checks(dtype):
    x = torch.randn(2, 5, 3, dtype=dtype)
    U, lam, v = _metric(dtype)
    unchecked = dict(check_values=False)
    assert ops.lowrank_metric_apply(U, -lam, v, 0.1, **unchecked).shape == v.shape
    assert ops.token_importance(U, -lam, 3, **unchecked).shape == (2, 3)
    kept, kept_idx, pruned, pruned_idx = reinsert_inputs(2, 4, 2, 3, dtype, "cpu")
    assert ops.reinsert_tokens(kept, kept_idx, pruned, kept_idx[:, :2], **unchecked).shape == (2, 6, 3)
    with pytest.raises(ValueError, match=r"idx must have shape \[B, K\] = \[2, \*\], got \[1, 2\]"):
        ops.gather_tokens(x, torch.tensor([[0, 1]]), **unchecked)
    with pytest.raises(TypeError, match=r"lam must have the dtype of U"):
        ops.lowrank_metric_apply(U, lam.double(), v, 0.1, **unchecked)
    with pytest.raises(ValueError, match=r"eps must be a finite value >= 0"):
        ops.lowrank_metric_quadform(U, lam, v, -1.0, **unchecked)
    with pytest.raises(ValueError, match=r"v contains 1 NaN"):
        ops.lowrank_metric_apply(U, lam, torch.where(v == v[0, 0, 0], math.nan, v), 0.1, check_finite=True, **unchecked)


# (op, arguments with one bad piece of metadata, exception, message): each fake kernel must reject
# what the eager front end rejects, with the same exception.
def _fake_cases(fake):
    U, lam, v = (fake(t) for t in _metric(torch.float32))
    x, w, src, dst = (fake(t) for t in merge_inputs(2, 6, 3, 2, torch.float32, "cpu"))
    kept, kept_idx, pruned, pruned_idx = (fake(t) for t in reinsert_inputs(2, 4, 2, 3, torch.float32, "cpu"))
    return [
        ("lowrank_metric_apply", (U, lam[:, :1], v, 0.1), ValueError, r"lam must have shape \[B, r\] = \[2, 2\]"),
        ("lowrank_metric_quadform", (U, lam, v.double(), 0.1), TypeError, r"v must have the dtype of U"),
        ("token_importance", (U, lam, 5), ValueError, r"num_tokens must divide P = 12"),
        ("block_orthonormalize", (U.mT,), ValueError, r"X must be tall with 1 <= r <= P"),
        ("gather_tokens", (x, src.int()), TypeError, r"idx must be an int64 index tensor"),
        ("merge_tokens", (x, w, src, dst[:, :1]), ValueError, r"dst_idx must have shape \[B, R\]"),
        ("reinsert_tokens", (kept, kept_idx, pruned[:, :, :2], pruned_idx), ValueError, r"pruned must have shape"),
    ]


def test_fake_kernels_check_metadata():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    for name, args, error, pattern in _fake_cases(mode.from_tensor):
        with mode, pytest.raises(error, match=pattern):
            getattr(torch.ops.pullback_ext, name)(*args)


def test_shape_errors_surface_under_torch_compile():
    torch._dynamo.reset()
    U, lam, v = _metric(torch.float32)
    message = r"lam must have shape \[B, r\] = \[2, 2\], got \[2, 1\]"
    apply = lambda U, lam, v: ops.lowrank_metric_apply(U, lam, v, 0.1, check_values=False)  # noqa: E731
    with pytest.raises(ValueError, match=message):
        torch.compile(apply, backend="aot_eager")(U, lam[:, :1], v)
    with pytest.raises(Exception, match=message):  # dynamo's error, naming ours
        torch.compile(apply, fullgraph=True, backend="aot_eager")(U, lam[:, :1], v)
    direct = torch.compile(lambda U, lam, v: torch.ops.pullback_ext.lowrank_metric_apply(U, lam, v, 0.1),
                           fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=message):  # raised by the fake kernel
        direct(U, lam[:, :1], v)
