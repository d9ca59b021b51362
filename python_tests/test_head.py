"""ImportanceHead: size, contract, and learning imp* of a real (random-weight) timm ViT CLS probe."""

import pytest
import torch

from helpers.metric import random_features, tiny_vit
from pullback_ext.metric import ImportanceHead, TargetConfig, TrainConfig, compute_targets, fit, parameter_count
from pullback_ext.metric.tasks import HeadTask, evaluate_head


def test_parameter_count_at_vit_b_width():
    head = ImportanceHead(768)
    count = parameter_count(head)
    print(f"ImportanceHead(768): {count:,} parameters")
    # docs/formulas.md §3: about 0.31M at D = 768, H = 256, 4 heads (input projection 0.197M + two attention blocks)
    assert 0.28e6 <= count <= 0.34e6


def test_scores_shape_and_bad_input():
    head = ImportanceHead(12, hidden=16, heads=2)
    assert head(torch.randn(3, 7, 12)).shape == (3, 7)
    assert torch.allclose(head.importance(torch.ones(1, 2, 12)), head(torch.ones(1, 2, 12)).exp())
    with pytest.raises(ValueError, match=r"F: expected shape \[B,N,12\]"):
        head(torch.randn(3, 7, 11))
    with pytest.raises(ValueError, match="heads"):
        ImportanceHead(12, hidden=16, heads=3)
    with pytest.raises(ValueError, match="mlp_hidden"):
        ImportanceHead(12, hidden=16, heads=2, mlp_hidden=-1)


def test_mlp_blocks_add_two_small_layers_per_block():
    plain, with_mlp = ImportanceHead(12, hidden=16, heads=2), ImportanceHead(12, hidden=16, heads=2, mlp_hidden=8)
    per_block = 2 * 16 + (16 * 8 + 8) + (8 * 16 + 16)  # LayerNorm + two linear layers
    assert parameter_count(with_mlp) - parameter_count(plain) == 2 * per_block
    assert with_mlp.config()["mlp_hidden"] == 8 and with_mlp(torch.randn(2, 5, 12)).shape == (2, 5)


def test_head_learns_imp_star_of_a_cls_probe(tmp_path):
    from pullback_ext.probes import from_timm

    probe = from_timm(tiny_vit(depth=3, img_size=48), 1, "cls")
    F = random_features(probe, 96, seed=0, img_size=48)
    imp = compute_targets(probe, F, TargetConfig(mode="exact", rank=8, keep_basis=False))["importance"]
    torch.manual_seed(0)
    head = ImportanceHead(probe.dim, hidden=32, heads=2).double()
    before = evaluate_head(head, F[64:], imp[64:])["mean"]
    fit(HeadTask(w_rank=0.5), head, {"features": F[:64], "importance": imp[:64]},
        TrainConfig(steps=200, batch_size=16, lr=3e-3, seed=0, checkpoint_every=200), tmp_path, progress=False)
    after = evaluate_head(head, F[64:], imp[64:])
    print(f"held-out Spearman: init {before:.3f}, trained {after['mean']:.3f} ± {after['std']:.3f}")
    assert before < 0.3
    assert after["mean"] >= 0.9 and after["count"] == 32


def test_score_offset_starts_at_the_mean_log_target():
    head = ImportanceHead(12, hidden=16, heads=2)
    target = torch.tensor([[1e-4, 1e-2], [0.0, 1e-3]])
    head.set_score_offset(target)
    assert float(head.score.bias) == pytest.approx(float(torch.tensor([1e-4, 1e-2, 1e-3]).log().mean()), rel=1e-6)
    with pytest.raises(ValueError, match="target"):
        head.set_score_offset(torch.zeros(2, 3))
