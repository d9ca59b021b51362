"""Losses and evaluation metrics of the learned metric against closed forms and scipy."""

import itertools
import math

import numpy as np
import pytest
import scipy.linalg
import scipy.stats
import torch

from pullback_ext.metric.evaluation import spearman_per_image, summarize
from pullback_ext.metric.losses import (
    energy_loss,
    importance_loss,
    log_regression_loss,
    nondegenerate_modes,
    ranking_loss,
    subspace_alignment,
    subspace_loss,
)


def _basis(B, P, r, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(B, P, r, generator=g, dtype=torch.float64)).Q


def test_subspace_loss_is_rotation_invariant_and_zero_on_same_span():
    V = _basis(3, 40, 5, 0)
    R = torch.linalg.qr(torch.randn(3, 5, 5, dtype=torch.float64)).Q
    assert subspace_loss(V @ R, V).abs().max() < 1e-12


def test_subspace_loss_is_one_for_orthogonal_spans_and_matches_principal_angles():
    Q = _basis(1, 30, 8, 1)
    assert float(subspace_loss(Q[..., :4], Q[..., 4:])) == pytest.approx(1.0, abs=1e-12)
    A, B = _basis(2, 30, 4, 2), _basis(2, 30, 4, 3)
    for b in range(2):
        cos = scipy.linalg.subspace_angles(A[b].numpy(), B[b].numpy())
        assert float(subspace_alignment(A, B)[b]) == pytest.approx(np.mean(np.cos(cos) ** 2), rel=1e-10)


def test_subspace_alignment_with_fewer_target_modes_is_fraction_captured():
    Q = _basis(1, 30, 6, 4)
    U = Q[..., :4]
    V = torch.cat([Q[..., :1], Q[..., 5:6]], dim=-1)
    assert float(subspace_alignment(U, V)) == pytest.approx(0.5, abs=1e-12)
    with pytest.raises(ValueError, match="m <= r"):
        subspace_alignment(V, U)


def test_nondegenerate_modes_excludes_both_members_of_a_close_pair():
    sigma = torch.tensor([[10.0, 5.0, 4.9, 2.0, 1.0, 0.99]])
    mask = nondegenerate_modes(sigma, 5)
    assert mask.tolist() == [[True, False, False, True, False]]
    assert nondegenerate_modes(torch.tensor([[3.0, 2.0, 0.0]]), 3).tolist() == [[True, True, False]]


def test_energy_loss_is_masked_log_mse():
    lam = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    target = torch.tensor([[math.e, 2.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    loss = energy_loss(lam, target, mask)
    assert float(loss.detach()) == pytest.approx((0 - 1) ** 2 / 2, rel=1e-6)
    loss.backward()
    assert lam.grad[0, 2] == 0


def test_ranking_loss_matches_brute_force_pairs():
    g = torch.Generator().manual_seed(5)
    scores, target = torch.randn(2, 7, generator=g), torch.rand(2, 7, generator=g)
    total, count = 0.0, 0
    for b, s, t in itertools.product(range(2), range(7), range(7)):
        if target[b, s] > target[b, t]:
            total += math.log1p(math.exp(-(scores[b, s] - scores[b, t])))
            count += 1
    assert float(ranking_loss(scores, target)) == pytest.approx(total / count, rel=1e-5)
    perfect = target.log() * 50
    assert float(ranking_loss(perfect, target)) < 0.05


def test_importance_loss_combines_terms():
    g = torch.Generator().manual_seed(6)
    scores, target = torch.randn(3, 9, generator=g), torch.rand(3, 9, generator=g) + 0.1
    reg = log_regression_loss(scores, target)
    assert float(reg) == pytest.approx(float(((scores - target.log()) ** 2).mean()), rel=1e-6)
    assert float(importance_loss(scores, target, 0.0)) == pytest.approx(float(reg))
    assert float(importance_loss(scores, target, 1.0)) == pytest.approx(float(reg + ranking_loss(scores, target)), rel=1e-6)


def test_spearman_matches_scipy_including_ties():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(5, 20, generator=g)
    b = a + 0.7 * torch.randn(5, 20, generator=g)
    b[0, :5] = 1.0  # ties
    rho = spearman_per_image(a, b)
    for i in range(5):
        assert float(rho[i]) == pytest.approx(scipy.stats.spearmanr(a[i].numpy(), b[i].numpy()).statistic, abs=1e-10)
    assert math.isnan(float(spearman_per_image(torch.ones(1, 4), torch.arange(4.0)[None])[0]))
    stats = summarize(torch.tensor([1.0, 3.0, float("nan")]))
    assert stats["mean"] == 2.0 and stats["std"] == 1.0 and stats["count"] == 2


def test_shape_errors_name_arguments():
    with pytest.raises(ValueError, match="target"):
        ranking_loss(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="scores, target"):
        spearman_per_image(torch.zeros(3), torch.zeros(3))


def test_pairing_loss_is_zero_only_for_matching_column_order():
    from pullback_ext.metric.losses import pairing_loss

    V = _basis(1, 20, 3, 8)
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert float(pairing_loss(V, V, mask)) == pytest.approx(0.0, abs=1e-12)
    swapped = V[..., [1, 0, 2]]
    assert float(pairing_loss(swapped, V, mask)) == pytest.approx(2 / 3, abs=1e-12)
    assert float(pairing_loss(swapped, V, torch.tensor([[False, False, True]]))) == pytest.approx(0.0, abs=1e-12)
    assert float(subspace_loss(swapped, V)) == pytest.approx(0.0, abs=1e-12)
