"""SPN acceptance in the controlled setting: a structurally rank-bounded probe (M = r outputs on the
CLS token of a real timm ViT). Held-out alignment against the exact subspace (dense SVD)."""

import pytest
import torch

from helpers.metric import dense_jacobian, head_probe, random_features, tiny_vit
from pullback_ext.metric import SPN, TargetConfig, TrainConfig, compute_targets, fit
from pullback_ext.metric.losses import subspace_alignment
from pullback_ext.metric.tasks import SPNTask, evaluate_spn

RANK = 3


@pytest.fixture(scope="module")
def setting():
    model = tiny_vit(depth=3, img_size=48)
    probe = head_probe(model, layer=1, outputs=RANK)
    F = random_features(probe, 96, seed=0, img_size=48)
    return probe, F[:64], F[64:]


def _train(probe, F, config, tmp_path, steps=200, w_order=0.0):
    targets = compute_targets(probe, F, config)
    torch.manual_seed(0)
    spn = SPN(probe.dim, RANK, hidden=32, heads=2).double()
    spn.set_energy_scale(targets["sigma"][:, :RANK] ** 2)
    fit(SPNTask(config, w_order=w_order), spn, {"features": F, **targets}, TrainConfig(steps=steps, batch_size=16, lr=3e-3, seed=0, checkpoint_every=steps),
        tmp_path, progress=False)
    return spn


def test_exact_held_out_targets_match_the_dense_oracle(setting):
    probe, _, held = setting
    V = compute_targets(probe, held[:2], TargetConfig(mode="exact", rank=RANK))["V"]
    for b in range(2):
        Vd = torch.linalg.svd(dense_jacobian(probe, held[b]), full_matrices=False).Vh[:RANK].T
        assert float(subspace_alignment(V[b : b + 1], Vd[None])) == pytest.approx(1.0, abs=1e-10)


def test_randnla_q1_reaches_the_exact_ceiling_and_random_init_does_not(setting, tmp_path):
    probe, train, held = setting
    V_held = compute_targets(probe, held, TargetConfig(mode="exact", rank=RANK))["V"]
    torch.manual_seed(0)
    init = evaluate_spn(SPN(probe.dim, RANK, hidden=32, heads=2).double(), held, V_held)["mean"]
    ceiling = evaluate_spn(_train(probe, train, TargetConfig(mode="exact", rank=RANK), tmp_path / "exact"), held, V_held)["mean"]
    randnla = evaluate_spn(_train(probe, train, TargetConfig(mode="randnla", rank=RANK, power=1), tmp_path / "q1"), held, V_held)["mean"]
    print(f"held-out alignment: random init {init:.3f}, exact-SVD ceiling {ceiling:.3f}, RandNLA q=1 {randnla:.3f}")
    assert init < 0.05
    assert ceiling >= 0.9
    assert randnla >= 0.9 and abs(randnla - ceiling) <= 0.02


def test_energy_branch_learns_the_singular_values(setting, tmp_path):
    probe, train, held = setting
    spn = _train(probe, train, TargetConfig(mode="exact", rank=RANK), tmp_path)
    sigma = compute_targets(probe, held, TargetConfig(mode="exact", rank=RANK))["sigma"][:, :RANK]
    with torch.no_grad():
        _, lam = spn(held)
    log_err = (lam.log() - sigma.pow(2).log()).abs()
    assert float(log_err.median()) < 0.5


def test_learned_columns_pair_with_their_energies(setting, tmp_path):
    probe, train, held = setting
    spn = _train(probe, train, TargetConfig(mode="exact", rank=RANK), tmp_path, w_order=1.0)
    t = compute_targets(probe, held, TargetConfig(mode="exact", rank=RANK))
    with torch.no_grad():
        g = spn.metric(held, eps=0.0)
    dense_imp = (t["V"].pow(2) * t["sigma"][:, None, :RANK].pow(2)).view(held.shape[0], probe.num_tokens, -1).sum(-1).sqrt()
    rel = (g.importance() - dense_imp).norm(dim=1) / dense_imp.norm(dim=1)
    print(f"imp_θ relative error vs imp*: median {float(rel.median()):.3f}")
    assert float(rel.median()) < 0.3
