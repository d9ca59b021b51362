"""Matrix-free operators and estimators against closed forms, dense SVD and scipy."""

import math
import re

import numpy as np
import pytest
import torch

from pullback_ext.linalg import (
    DenseOperator,
    JacobianOperator,
    LinearOperatorBase,
    deflated_xnystrace,
    exact_trace,
    hutchinson,
    hutchpp,
    orthonormalize,
    randomized_svd,
    slq_effective_rank,
    subspace_alignment,
    token_energy,
)

from helpers.diagnose import dense_jacobian, tiny_timm_vit


def known_spectrum(M=60, P=200, decay=5.0, seed=0):
    """J = U diag(s) Wᵀ with s_j = exp(-j/decay): returns (J, s, W)."""
    g = torch.Generator().manual_seed(seed)
    k = min(M, P)
    U, _ = torch.linalg.qr(torch.randn(M, k, generator=g, dtype=torch.float64))
    W, _ = torch.linalg.qr(torch.randn(P, k, generator=g, dtype=torch.float64))
    s = torch.exp(-torch.arange(k, dtype=torch.float64) / decay)
    return (U * s) @ W.T, s, W


def entropy_rank(s):
    lam = s**2
    p = lam[lam > 0] / lam.sum()
    return math.exp(float(-(p * p.log()).sum()))


@pytest.mark.parametrize("power", [4, 6])
def test_rsvd_recovers_known_spectrum(power):
    J, s, W = known_spectrum()
    res = randomized_svd(DenseOperator(J), 10, power=power, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(res.sigma, s[:10], rtol=1e-3, atol=0)
    assert subspace_alignment(res.V, W[:, :10]) >= 0.999
    assert len(res.defects) == power and res.power == power
    torch.testing.assert_close(res.V.T @ res.V, torch.eye(10, dtype=torch.float64), atol=1e-10, rtol=0)
    assert res.energy == pytest.approx(float((J @ res.V).square().sum()), rel=1e-10)


def test_power_rounds_shrink_the_defect_and_adaptive_mode_stops():
    J, s, W = known_spectrum(decay=3.0)
    op = DenseOperator(J)
    errors = []
    for q in (0, 1, 3):
        res = randomized_svd(op, 8, oversample=2, power=q, generator=torch.Generator().manual_seed(2))
        errors.append(1 - subspace_alignment(res.V, W[:, :8]))
    assert errors[0] > errors[1] > errors[2]
    res = randomized_svd(op, 8, oversample=2, generator=torch.Generator().manual_seed(2), adaptive_tol=1e-8, max_power=30)
    assert res.converged and res.defects[-1] < 1e-8 and res.power < 30
    stuck = randomized_svd(op, 8, oversample=0, generator=torch.Generator().manual_seed(2), adaptive_tol=1e-14, max_power=2)
    assert not stuck.converged and stuck.power == 2


def test_rsvd_agrees_with_scipy_svds_on_a_jacobian_operator():
    from scipy.sparse.linalg import LinearOperator, svds

    from pullback_ext.probes import from_timm

    model = tiny_timm_vit()
    probe = from_timm(model, 1, "tokens")
    F = probe.features(torch.randn(1, 3, 32, 32, dtype=torch.float64)).F[0]
    op = JacobianOperator(probe, F, chunk_size=8)
    wrapped = LinearOperator(
        shape=op.shape,
        dtype=np.float64,
        matvec=lambda v: op.jvp(torch.from_numpy(np.asarray(v, dtype=np.float64).reshape(-1, 1)))[:, 0].numpy(),
        rmatvec=lambda u: op.vjp(torch.from_numpy(np.asarray(u, dtype=np.float64).reshape(-1, 1)))[:, 0].numpy(),
        matmat=lambda V: op.jvp(torch.from_numpy(np.ascontiguousarray(V, dtype=np.float64))).numpy(),
        rmatmat=lambda U: op.vjp(torch.from_numpy(np.ascontiguousarray(U, dtype=np.float64))).numpy(),
    )
    s_ref = np.sort(svds(wrapped, k=5, tol=1e-10, random_state=0, solver="arpack", return_singular_vectors=False))[::-1]
    res = randomized_svd(op, 5, power=6, generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(res.sigma.numpy(), s_ref, rtol=1e-3)


def test_jacobian_operator_matches_dense_jacobian_for_any_chunk_size():
    from pullback_ext.probes import from_timm

    model = tiny_timm_vit()
    probe = from_timm(model, 0, "cls")
    F = probe.features(torch.randn(1, 3, 32, 32, dtype=torch.float64)).F[0]
    J = dense_jacobian(probe, F)
    g = torch.Generator().manual_seed(0)
    V = torch.randn(J.shape[1], 7, generator=g, dtype=torch.float64)
    U = torch.randn(J.shape[0], 5, generator=g, dtype=torch.float64)
    for chunk in (None, 1, 3):
        op = JacobianOperator(probe, F, chunk_size=chunk)
        assert op.shape == tuple(J.shape)
        torch.testing.assert_close(op.jvp(V), J @ V, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(op.vjp(U), J.T @ U, rtol=1e-9, atol=1e-9)
        assert (op.num_jvp, op.num_vjp) == (7, 5)


@pytest.mark.parametrize("shape", [(30, 200), (200, 30)])
def test_trace_estimators(shape):
    J, s, _ = known_spectrum(*shape, decay=8.0)
    op = DenseOperator(J)
    T = float((s**2).sum())
    exact = exact_trace(op, chunk=7)
    assert exact.value == pytest.approx(T, rel=1e-12) and exact.stderr == 0
    h = hutchinson(op, 200, torch.Generator().manual_seed(0))
    assert abs(h.value - T) < 4 * h.stderr and h.stderr > 0
    res = randomized_svd(op, 10, power=3, generator=torch.Generator().manual_seed(0))
    hp = hutchpp(op, res.V, 200, torch.Generator().manual_seed(0))
    assert hp.value >= res.energy - 1e-12
    assert abs(hp.value - T) < 4 * hp.stderr + 1e-12
    assert hp.stderr < h.stderr


def test_trace_method_rule_and_total_sensitivity_record_the_estimator():
    from pullback_ext.linalg import EXACT_TRACE_MAX, total_sensitivity, trace_method

    # auto: exact while the smaller side has at most 512 dimensions (docs/formulas.md §2), else XNysTrace
    assert trace_method((EXACT_TRACE_MAX, 10_000)) == "exact" == trace_method((10_000, EXACT_TRACE_MAX))
    assert trace_method((EXACT_TRACE_MAX + 1, 10_000)) == "xnystrace" == trace_method((10_000, EXACT_TRACE_MAX + 1))
    explicit = ("exact", "hutchinson", "hutch++", "xnystrace")
    assert [trace_method((EXACT_TRACE_MAX + 1, 10_000), m) for m in explicit] == list(explicit)
    with pytest.raises(ValueError, match="trace"):
        trace_method((3, 4), "magic")
    J, s, _ = known_spectrum(30, 200, decay=8.0)
    op = DenseOperator(J)
    exact = total_sensitivity(op)
    assert exact.method == "exact" and exact.value == pytest.approx(float((s**2).sum()), rel=1e-12)
    res = randomized_svd(op, 10, power=3, generator=torch.Generator().manual_seed(0))
    for method, direct in (
        ("hutchinson", lambda g: hutchinson(op, 50, g)),
        ("hutch++", lambda g: hutchpp(op, res.V, 50, g)),
        ("xnystrace", lambda g: deflated_xnystrace(op, res.V, 20, g)),
    ):
        probes = 20 if method == "xnystrace" else 50
        got = total_sensitivity(op, method, probes, torch.Generator().manual_seed(4), basis=res.V)
        want = direct(torch.Generator().manual_seed(4))
        assert got.method == method and (got.value, got.stderr) == (want.value, want.stderr)
    for method in ("hutch++", "xnystrace"):
        with pytest.raises(ValueError, match=f"basis: '{re.escape(method)}' deflates"):
            total_sensitivity(op, method, 20)


class ShapeOnly(LinearOperatorBase):
    """An operator known by its shape alone (for the method rules, which never multiply)."""

    def __init__(self, M: int, P: int) -> None:
        super().__init__()
        self.shape, self.dtype, self.device = (M, P), torch.float64, torch.device("cpu")


def test_svd_method_rule_and_top_spectrum():
    from pullback_ext.linalg import dense_spectrum, svd_method, top_spectrum

    J, s, W = known_spectrum(30, 200, decay=4.0)
    op = DenseOperator(J)
    # auto: dense exactly when the trace is exact (its basis products form J) and J fits
    assert svd_method(op) == "dense" and svd_method(op, trace="hutch++") == "randomized"
    assert svd_method(op, "randomized") == "randomized"
    assert svd_method(ShapeOnly(600, 600)) == "randomized"  # stochastic trace
    assert svd_method(ShapeOnly(400, 1 << 20)) == "randomized"  # exact trace, but J takes 3.2 GB
    with pytest.raises(ValueError, match="svd"):
        svd_method(op, "magic")
    with pytest.raises(ValueError, match="svd: 'dense' needs J"):
        svd_method(ShapeOnly(400, 1 << 20), "dense")
    dense = top_spectrum(op, 5)
    ref = dense_spectrum(DenseOperator(J), 5)
    assert dense.method == "dense" and dense.power == 0 and dense.trace == pytest.approx(float((s**2).sum()), rel=1e-12)
    torch.testing.assert_close(dense.sigma, ref.sigma[:5], rtol=0, atol=0)
    assert dense.entropy.exact
    sketched = top_spectrum(op, 5, "randomized", oversample=5, power=3, generator=torch.Generator().manual_seed(0))
    direct = randomized_svd(op, 5, 5, 3, torch.Generator().manual_seed(0))
    assert sketched.method == "randomized" and sketched.trace is None and sketched.power == 3
    torch.testing.assert_close(sketched.sigma, direct.sigma.double(), rtol=0, atol=0)
    assert subspace_alignment(sketched.V, W[:, :5]) > 0.999


def test_hutchinson_is_unbiased_over_seeds():
    J, s, _ = known_spectrum(40, 80, decay=10.0)
    op = DenseOperator(J)
    T = float((s**2).sum())
    values = torch.tensor([hutchinson(op, 10, torch.Generator().manual_seed(i)).value for i in range(200)])
    assert abs(float(values.mean()) - T) < 4 * float(values.std()) / math.sqrt(200)


@pytest.mark.parametrize("shape", [(60, 300), (300, 60)])
def test_slq_effective_rank_matches_spectral_entropy(shape):
    J, s, _ = known_spectrum(*shape, decay=12.0)
    est = slq_effective_rank(DenseOperator(J), probes=100, steps=30, generator=torch.Generator().manual_seed(0))
    assert est.side == ("JJt" if shape[0] < shape[1] else "JtJ")
    assert est.r_eff == pytest.approx(entropy_rank(s), rel=0.05)


def test_slq_is_exact_when_the_small_side_fits_in_the_krylov_space():
    J, s, _ = known_spectrum(3, 50, decay=1.0)
    est = slq_effective_rank(DenseOperator(J), probes=20, steps=30, generator=torch.Generator().manual_seed(0))
    assert est.exact and est.r_eff == pytest.approx(entropy_rank(s), rel=1e-10)


def test_lanczos_survives_krylov_breakdown():
    from pullback_ext.linalg import lanczos_quadrature

    # rank-2 PSD operator on R^40: every Krylov space is exhausted after 3 steps
    J, s, _ = known_spectrum(2, 40, decay=1.0)
    A = J.T @ J
    quad = lanczos_quadrature(lambda X: A @ X, 40, 50, 10, torch.float64, "cpu", torch.Generator().manual_seed(0))
    assert torch.isfinite(quad.nodes).all() and torch.isfinite(quad.weights).all()
    torch.testing.assert_close(quad.weights.sum(1), torch.ones(50, dtype=torch.float64))
    heavy = quad.nodes[quad.weights > 1e-8]
    assert all(min(abs(float(x) - float(l)) for l in (0.0, *(s**2).tolist())) < 1e-8 for x in heavy)


def test_token_energy_closed_form():
    V, _ = torch.linalg.qr(torch.randn(12, 3, dtype=torch.float64))
    sigma = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    e = token_energy(V, sigma, 4)
    expected = torch.stack([(sigma**2 * V[3 * t : 3 * t + 3].square().sum(0)).sum() for t in range(4)])
    torch.testing.assert_close(e, expected)
    assert float(e.sum()) == pytest.approx(14.0)


def test_orthonormalize_spans_input():
    X = torch.randn(50, 6, dtype=torch.float64)
    Q = orthonormalize(X)
    torch.testing.assert_close(Q.T @ Q, torch.eye(6, dtype=torch.float64), atol=1e-10, rtol=0)
    torch.testing.assert_close(Q @ (Q.T @ X), X, atol=1e-10, rtol=0)


def test_bad_inputs_are_rejected_with_named_arguments():
    J, _, _ = known_spectrum(10, 20)
    op = DenseOperator(J)
    with pytest.raises(ValueError, match="rank"):
        randomized_svd(op, 11)
    with pytest.raises(ValueError, match="rank"):
        randomized_svd(op, 0)
    with pytest.raises(ValueError, match="power"):
        randomized_svd(op, 2, power=-1)
    with pytest.raises(ValueError, match="adaptive_tol"):
        randomized_svd(op, 2, adaptive_tol=2.0)
    with pytest.raises(TypeError, match="op"):
        randomized_svd(J, 2)
    with pytest.raises(ValueError, match="V"):
        op.jvp(torch.zeros(19, 2, dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype"):
        op.vjp(torch.zeros(10, 2, dtype=torch.float32))
    with pytest.raises(ValueError, match="A, B"):
        subspace_alignment(torch.zeros(5, 2), torch.zeros(5, 3))
    with pytest.raises(ValueError, match="probes"):
        hutchinson(op, 1)
    with pytest.raises(ValueError, match="J"):
        DenseOperator(torch.zeros(3))
    probe = lambda F: F.sum(-1)  # noqa: E731
    with pytest.raises(ValueError, match="F"):
        JacobianOperator(probe, torch.zeros(2, 3, 4, 5))
    with pytest.raises(TypeError, match="F"):
        JacobianOperator(probe, torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="NaN"):
        JacobianOperator(probe, torch.full((3, 4), float("nan")))
    with pytest.raises(ValueError, match="chunk_size"):
        JacobianOperator(probe, torch.zeros(3, 4), chunk_size=0)
    with pytest.raises(ValueError, match="NaN"):
        JacobianOperator(lambda F: F.log().sum(-1), -torch.ones(3, 4))
