"""Quality metrics against closed forms and scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pullback_ext.comparison.quality import cosine_x100, knn_top1, silog_x100, wilcoxon_p
from pullback_ext.errors import PullbackError


def test_cosine_x100_closed_forms():
    e = torch.tensor([[1.0, 0.0], [1.0, 0.0], [3.0, 4.0]])
    r = torch.tensor([[2.0, 0.0], [0.0, 1.0], [-3.0, -4.0]])
    np.testing.assert_allclose(cosine_x100(r, e).numpy(), [0.0, 100.0, 200.0], atol=1e-12)


def test_silog_x100_is_scale_invariant_and_matches_numpy():
    g = torch.Generator().manual_seed(0)
    full = torch.rand(3, 5, 4, generator=g, dtype=torch.float64) + 0.5
    assert torch.allclose(silog_x100(full * 1.7, full), torch.zeros(3, dtype=torch.float64), atol=1e-6)
    reduced = full * torch.exp(0.1 * torch.randn(3, 5, 4, generator=g, dtype=torch.float64))
    d = (np.log(reduced.double().numpy()) - np.log(full.double().numpy())).reshape(3, -1)
    expected = 100 * np.sqrt((d**2).mean(1) - d.mean(1) ** 2)
    np.testing.assert_allclose(silog_x100(reduced, full).numpy(), expected, rtol=1e-9)
    with pytest.raises(PullbackError, match="strictly positive"):
        silog_x100(-full, full)
    with pytest.raises(PullbackError, match="one shape"):
        silog_x100(full[:, :2], full)


def test_knn_top1_on_separable_clusters_and_leave_one_out():
    g = torch.Generator().manual_seed(0)
    centres = torch.eye(3) * 10
    labels = torch.arange(3).repeat_interleave(4)
    bank = centres[labels] + 0.1 * torch.randn(12, 3, generator=g)
    assert knn_top1(bank, labels, bank, labels, k=3, exclude_self=True) == 1.0
    assert knn_top1(bank, labels, bank, (labels + 1) % 3, k=3, exclude_self=True) == 0.0
    # with k = 1 and leave-one-out, a lone point of its class is misclassified
    lone = torch.cat([bank, torch.tensor([[10.0, 10.0, 10.0]])])
    lone_labels = torch.cat([labels, torch.tensor([3])])
    assert knn_top1(lone, lone_labels, lone, lone_labels, k=1, exclude_self=True) == pytest.approx(12 / 13)


def test_wilcoxon_is_one_sided_and_matches_scipy():
    from scipy.stats import wilcoxon

    g = torch.Generator().manual_seed(0)
    base = torch.rand(40, generator=g) + 1
    ours = base - 0.3 * torch.rand(40, generator=g)
    p = wilcoxon_p(ours, base)
    assert p < 1e-6
    assert math.isclose(p, wilcoxon(ours.double().numpy(), base.double().numpy(), alternative="less").pvalue)
    assert wilcoxon_p(base, ours) > 0.99
    assert wilcoxon_p(base, base) is None
