"""Geosubprobe-style interventions: closed forms of a linear probe's pullback geometry."""

from __future__ import annotations

import pytest
import torch

from pullback_ext.errors import PullbackError
from pullback_ext.studies.subspace import fit_linear_probe, interventions, probe_basis, projector


def _planted(c=3, d=12, b=4, t=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(c, d, generator=g, dtype=torch.float64)
    bias = torch.randn(c, generator=g, dtype=torch.float64)
    x = torch.randn(b, t, d, generator=g, dtype=torch.float64)
    return w, bias, x


def test_fit_linear_probe_recovers_a_planted_probe():
    w, bias, x = _planted()
    fw, fb = fit_linear_probe(x, x @ w.T + bias, ridge=1e-10)
    torch.testing.assert_close(fw, w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fb, bias, rtol=1e-6, atol=1e-6)


def test_interventions_closed_forms():
    w, bias, x = _planted()
    out = interventions(x, w, bias, ks=(1, 3, 12))
    assert out["rank"] == 3
    sub = {r["k"]: r for r in out["results"]["subspace"]}
    comp = {r["k"]: r for r in out["results"]["complement"]}
    rnd = {r["k"]: r for r in out["results"]["random"]}
    # rank(W) = 3: the top-3 subspace keeps the probe exactly, its complement removes it entirely
    assert sub[3]["output_change"] < 1e-10 and sub[3]["energy"] == pytest.approx(1.0)
    y = x.reshape(-1, 12) @ w.T
    expected = float(y.norm() / (y + bias - (y + bias).mean(0)).norm())
    assert comp[3]["output_change"] == pytest.approx(expected) and comp[3]["energy"] == pytest.approx(0.0, abs=1e-12)
    # the energy of the top-1 subspace is σ1² / Σσ²
    s = torch.linalg.svdvals(w)
    assert sub[1]["energy"] == pytest.approx(float(s[0] ** 2 / s.square().sum()))
    # a random k = D subspace is the identity; a random 1-d one keeps less than the top direction
    assert rnd[12]["output_change"] < 1e-10
    assert rnd[1]["energy"] < sub[1]["energy"]


def test_projector_checks_its_arguments():
    basis, _ = probe_basis(torch.randn(2, 5, dtype=torch.float64))
    with pytest.raises(PullbackError, match="intervention must be one of"):
        projector("other", basis, 1)
    with pytest.raises(PullbackError, match="at most the probe's 2"):
        projector("subspace", basis, 3)
    p = projector("complement", basis, 2)
    torch.testing.assert_close(p @ p, p)
