"""SPN: output contract, the inference metric against its dense closed form, the geodesic surrogate."""

import pytest
import torch

from pullback_ext.metric import SPN, LowRankMetric


def _spn(dim=8, rank=3, seed=0):
    torch.manual_seed(seed)
    return SPN(dim, rank, hidden=16, heads=2, eps=0.05).double()


def _dense_metric(U, lam, eps):
    return eps * torch.eye(U.shape[0], dtype=U.dtype) + U @ torch.diag(lam) @ U.T


def test_outputs_are_orthonormal_bases_and_positive_energies_in_train_and_eval():
    spn = _spn()
    F = torch.randn(2, 5, 8, dtype=torch.float64)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            U, lam = spn(F)
        assert U.shape == (2, 40, 3) and lam.shape == (2, 3)
        eye = torch.eye(3, dtype=torch.float64).expand(2, 3, 3)
        assert torch.allclose(U.transpose(1, 2) @ U, eye, atol=1e-10)
        assert (lam > 0).all()
    U, lam = spn(F)
    (U.sum() + lam.sum()).backward()
    assert all(p.grad is not None for p in spn.parameters())


def test_eval_path_spans_the_same_subspace_as_the_training_path():
    spn = _spn()
    F = torch.randn(3, 5, 8, dtype=torch.float64)
    U_train, lam_train = spn(F)
    with torch.no_grad():
        U_eval, lam_eval = spn(F)
    overlap = (U_train.detach().transpose(1, 2) @ U_eval).pow(2).sum((1, 2)) / 3
    assert torch.allclose(overlap, torch.ones(3, dtype=torch.float64), atol=1e-10)
    assert torch.equal(lam_train.detach(), lam_eval)


def test_metric_products_match_the_dense_closed_form():
    spn = _spn()
    F = torch.randn(2, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        g = spn.metric(F)
    assert isinstance(g, LowRankMetric)
    v = torch.randn(2, 40, 4, dtype=torch.float64)
    for b in range(2):
        G = _dense_metric(g.U[b], g.lam[b], 0.05)
        assert torch.allclose(g.apply(v)[b], G @ v[b], atol=1e-12)
        assert torch.allclose(g.quadform(v)[b], torch.einsum("pk,pq,qk->k", v[b], G, v[b]), atol=1e-12)
        expected_imp = (g.U[b].pow(2) * g.lam[b]).view(5, 8, 3).sum((1, 2)).sqrt()
        assert torch.allclose(g.importance()[b], expected_imp, atol=1e-12)
    feature_shaped = torch.randn(2, 5, 8, dtype=torch.float64)
    assert g.apply(feature_shaped).shape == (2, 5, 8)
    assert torch.allclose(g.quadform(feature_shaped), g.quadform(feature_shaped.reshape(2, 40, 1))[:, 0])


def test_distance_is_midpoint_quadrature_of_the_learned_metric():
    spn = _spn()
    g = torch.Generator().manual_seed(3)
    F1, F2 = torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64)
    with torch.no_grad():
        for K in (1, 3):
            delta = (F2 - F1) / K
            expected = torch.zeros(2, dtype=torch.float64)
            for k in range(K):
                m = spn.metric(F1 + (k + 0.5) * delta)
                for b in range(2):
                    G = _dense_metric(m.U[b], m.lam[b], spn.eps)
                    expected[b] += (delta[b].reshape(-1) @ G @ delta[b].reshape(-1)).sqrt()
            assert torch.allclose(spn.distance(F1, F2, steps=K), expected, atol=1e-10)
        assert torch.allclose(spn.distance(F1, F2, steps=4), spn.distance(F2, F1, steps=4), atol=1e-10)
        assert torch.equal(spn.distance(F1, F1, steps=2), torch.zeros(2, dtype=torch.float64))


def test_bad_inputs_name_the_argument():
    spn = _spn()
    with pytest.raises(ValueError, match=r"F: expected shape \[B,N,8\]"):
        spn(torch.zeros(2, 5, 7, dtype=torch.float64))
    with pytest.raises(TypeError, match="F: expected a floating-point"):
        spn(torch.zeros(2, 5, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="rank: expected <= P"):
        SPN(2, 5, hidden=16, heads=2)(torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match="rank: expected a positive int"):
        SPN(8, 0)
    with pytest.raises(ValueError, match="steps"):
        spn.distance(torch.zeros(1, 5, 8, dtype=torch.float64), torch.zeros(1, 5, 8, dtype=torch.float64), steps=0)
    with pytest.raises(ValueError, match="F2: expected the shape of F1"):
        spn.distance(torch.zeros(1, 5, 8, dtype=torch.float64), torch.zeros(2, 5, 8, dtype=torch.float64))
    with torch.no_grad():
        g = spn.metric(torch.zeros(1, 5, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="v: expected shape"):
        g.apply(torch.zeros(1, 39, 1, dtype=torch.float64))
