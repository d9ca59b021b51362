"""block_orthonormalize (CholeskyQR2 + Householder fallback) against scipy.linalg.qr."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from helpers.ops import DEVICES
from pullback_ext import ops, reference

ORTHO_TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 1e-5, torch.bfloat16: 1e-5}


def _scipy_qr(X: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Economic Householder QR of each X[b] in float64 with diag(R) >= 0."""
    Qs, Rs = [], []
    for x in X.detach().cpu().double().numpy():
        q, r = scipy.linalg.qr(x, mode="economic")
        sign = np.where(np.diag(r) < 0, -1.0, 1.0)
        Qs.append(q * sign)
        Rs.append(r * sign[:, None])
    return np.stack(Qs), np.stack(Rs)


def _orthogonality(Q: torch.Tensor) -> float:
    Qd = Q.double().cpu()
    return float((Qd.mT @ Qd - torch.eye(Q.shape[-1], dtype=torch.float64)).abs().max())


def _check_factorisation(X, Q, R, dtype):
    Xd = X.double().cpu()
    assert Q.shape == X.shape and R.shape == (X.shape[0], X.shape[2], X.shape[2])
    assert Q.dtype == dtype and R.dtype == dtype
    assert _orthogonality(Q) <= ORTHO_TOL[dtype]
    Rd = R.double().cpu()
    assert torch.equal(Rd, Rd.triu())
    assert bool((Rd.diagonal(dim1=-2, dim2=-1) >= 0).all())
    recon = (Q.double().cpu() @ Rd - Xd).abs().max() / Xd.abs().max()
    assert float(recon) <= (1e-5 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,P,r", [(1, 7, 1), (3, 40, 5), (2, 33, 33), (1, 5000, 20), (2, 97, 24)])
def test_qr_matches_scipy(B, P, r, dtype, device):
    X = torch.randn(B, P, r, dtype=torch.float64, generator=torch.Generator().manual_seed(P + r)).to(device, dtype)
    Q, R = ops.block_orthonormalize(X, return_r=True)
    _check_factorisation(X, Q, R, dtype)
    Q_ref, R_ref = _scipy_qr(X)
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    np.testing.assert_allclose(Q.double().cpu().numpy(), Q_ref, atol=tol * 10)
    np.testing.assert_allclose(R.double().cpu().numpy(), R_ref, rtol=tol, atol=tol * np.abs(R_ref).max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_qr_rank_deficient_columns_are_completed(dtype, device):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 300, 3, dtype=torch.float64, generator=g)
    X = torch.cat([base, base[..., :2] @ torch.randn(2, 2, 2, dtype=torch.float64, generator=g),
                   torch.zeros(2, 300, 1, dtype=torch.float64)], dim=-1).to(device, dtype)  # rank 3 of 6
    Q, R = ops.block_orthonormalize(X, return_r=True)
    assert _orthogonality(Q) <= ORTHO_TOL[dtype]
    Xd = X.double().cpu()
    recon = (Q.double().cpu() @ R.double().cpu() - Xd).abs().max() / Xd.abs().max()
    assert float(recon) <= (1e-5 if dtype == torch.float32 else 1e-12)
    # The first three columns of Q span range(X), as scipy's do.
    Q_ref, _ = _scipy_qr(X)
    proj = Q.double().cpu()[..., :3].mT @ torch.from_numpy(Q_ref[..., :3])
    torch.testing.assert_close(torch.linalg.svdvals(proj), torch.ones(2, 3, dtype=torch.float64), atol=1e-4, rtol=0)
    assert float(R.double().cpu().diagonal(dim1=-2, dim2=-1)[:, 3:].abs().max()) <= 1e-4 * float(Xd.abs().max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_qr_badly_scaled_columns(dtype, device):
    g = torch.Generator().manual_seed(5)
    scales = torch.logspace(-6, 6, 8, dtype=torch.float64)
    X = (torch.randn(3, 500, 8, dtype=torch.float64, generator=g) * scales).to(device, dtype)
    X[1, :, 4] = X[1, :, 3] * 1.0000001 * scales[4] / scales[3]  # nearly dependent pair
    Q, R = ops.block_orthonormalize(X, return_r=True)
    assert _orthogonality(Q) <= ORTHO_TOL[dtype]
    Xd = X.double().cpu()
    recon = (Q.double().cpu() @ R.double().cpu() - Xd).abs() / Xd.abs().amax(dim=1, keepdim=True)
    assert float(recon.max()) <= (1e-5 if dtype == torch.float32 else 1e-10)
    # image 0 is full rank: same factors as scipy up to the conditioning of each column
    Q_ref, _ = _scipy_qr(X[:1])
    np.testing.assert_allclose(Q[:1].double().cpu().numpy(), Q_ref, atol=1e-3 if dtype == torch.float32 else 1e-8)


@pytest.mark.parametrize("device", DEVICES)
def test_qr_float32_near_the_fallback_threshold(device):
    """κ(X) ≈ 1e5 stays on the CholeskyQR2 path (the fallback starts at 1e6), where float32 X gets
    its last pass as one product X (R1⁻¹ R2⁻¹): still orthonormal, and equal to the float64
    factorisation of the same (float32-representable) X to float32 rounding."""
    g = torch.Generator().manual_seed(11)
    X64 = torch.linalg.qr(torch.randn(2, 4000, 12, dtype=torch.float64, generator=g))[0]
    X64 = (X64 * torch.logspace(0, -5, 12, dtype=torch.float64)) @ torch.linalg.qr(torch.randn(2, 12, 12, dtype=torch.float64, generator=g))[0]
    X = X64.float().to(device)
    Q, R = ops.block_orthonormalize(X, return_r=True)
    _check_factorisation(X, Q, R, torch.float32)
    Q64 = ops.block_orthonormalize(X.double().cpu())
    torch.testing.assert_close(Q.double().cpu(), Q64, atol=2e-6, rtol=0)


def test_qr_mixed_batch_only_falls_back_where_needed():
    g = torch.Generator().manual_seed(9)
    X = torch.randn(3, 64, 4, dtype=torch.float64, generator=g)
    X[1, :, 3] = X[1, :, 0]
    Q = ops.block_orthonormalize(X)
    assert _orthogonality(Q) <= 1e-12
    torch.testing.assert_close(Q[[0, 2]], torch.from_numpy(_scipy_qr(X[[0, 2]])[0]))


def test_qr_isa_variants_agree(tmp_path):
    """Every compiled instruction-set variant of the row kernels gives the same results (the k = 1
    metric kernels included: their vector width splits r = 3 and r = 7 differently)."""
    import os
    import subprocess
    import sys

    import pullback_ext

    root = os.path.dirname(os.path.dirname(os.path.abspath(pullback_ext.__file__)))

    script = (
        "import torch, sys; from pullback_ext import ops, _C;"
        "X = torch.randn(2, 999, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0));"
        "Q, R = ops.block_orthonormalize(X, True);"
        "U = X[..., :3].contiguous(); lam = torch.rand(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1));"
        "torch.save({'Q': Q, 'R': R, 'imp': ops.token_importance(U, lam, 9),"
        " 'y': ops.lowrank_metric_apply(U, lam, X[..., 3:5], 0.2),"
        " 'y1': ops.lowrank_metric_apply(X, torch.ones(2, 7, dtype=X.dtype), X[..., 5:6].contiguous(), 0.2),"
        " 'q1': ops.lowrank_metric_quadform(U, lam, X[..., 3:4].contiguous(), 0.2),"
        " 'g': ops.gather_tokens(X.view(2, 333, 21)[:, :, :19].contiguous(), torch.arange(330).view(2, 165) % 333),"
        " 'Q32': ops.block_orthonormalize(X.float()),"
        " 'isa': _C.cpu_isa()}, sys.argv[1])"
    )
    results = {}
    for isa in ("baseline", "avx2", "avx512"):
        out = tmp_path / f"{isa}.pt"
        env = {**os.environ, "PULLBACK_CPU_ISA": isa, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
        subprocess.run([sys.executable, "-c", script, str(out)], check=True, env=env, cwd=root)
        results[isa] = torch.load(out)
    base = results["baseline"]
    assert base["isa"] == "baseline"
    X = torch.randn(2, 999, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    # rows of 19 float64 (152 bytes): the vector copy's unrolled, single-vector and byte tails
    x = X.view(2, 333, 21)[:, :, :19].contiguous()
    assert torch.equal(base["g"], reference.gather_tokens(x, torch.arange(330).view(2, 165) % 333))
    for isa, res in results.items():
        assert torch.equal(res["g"], base["g"])
        for key in ("Q", "R", "imp", "y", "y1", "q1"):
            torch.testing.assert_close(res[key], base[key], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res["Q32"], base["Q32"], rtol=0, atol=1e-6)
