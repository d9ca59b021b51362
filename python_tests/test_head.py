"""ImportanceHead: size, contract, and learning imp* of a real (random-weight) timm ViT CLS probe."""

from pathlib import Path

import pytest
import torch

from helpers.metric import random_features, tiny_vit
from pullback_ext.metric import ImportanceHead, TargetConfig, TrainConfig, compute_targets, fit, parameter_count
from pullback_ext.metric.tasks import HeadTask, evaluate_head


def test_parameter_count_at_vit_b_width():
    """The count docs/metric.md states (331,521 at D = 768, against the paper's ≈ 0.31 M), part by part."""
    D, H = 768, 256
    attn = H // 4  # qkv width per q/k/v (heads × head size)
    projection = 2 * D + (D * H + H) + H  # input LayerNorm, D -> H, log-RMS embedding
    block = 2 * H + H * 3 * attn + (attn * H + H)  # LayerNorm, bias-free qkv, output projection
    assert projection + 2 * block + (H + 1) == 331_521
    assert parameter_count(ImportanceHead(768)) == 331_521
    assert "331,521" in (Path(__file__).resolve().parents[1] / "docs" / "metric.md").read_text()


def _layer_norm(x, norm):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


def _scores_by_hand(head, F):
    """docs/formulas.md §3 written out from the head's parameters: per-head softmax attention with
    explicit slices of the qkv output, no module forward."""
    encoder = head.encoder
    log_rms = 0.5 * torch.log(F.pow(2).mean(-1, keepdim=True) + 1e-12)
    h = _layer_norm(F, encoder.input_norm) @ encoder.embed.weight.T + encoder.embed.bias + log_rms * encoder.scale_embed.weight[:, 0]
    for block in encoder.blocks:
        z = _layer_norm(h, block.norm) @ block.qkv.weight.T
        width = z.shape[-1] // 3
        size = width // block.heads
        heads = []
        for i in range(block.heads):
            q, k, v = (z[..., part * width + i * size: part * width + (i + 1) * size] for part in range(3))
            heads.append(torch.softmax(q @ k.transpose(-1, -2) / size ** 0.5, dim=-1) @ v)
        h = h + torch.cat(heads, -1) @ block.proj.weight.T + block.proj.bias
    return h @ head.score.weight[0] + head.score.bias


def test_scores_and_importance_against_the_formula_written_out():
    torch.manual_seed(0)
    head = ImportanceHead(12, hidden=16, heads=2).double()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))  # LayerNorm weights and biases away from 1 and 0 too
        head.set_score_offset(torch.tensor([1e-3, 1e-2]))
    F = torch.randn(3, 7, 12, dtype=torch.float64) * torch.linspace(0.1, 10, 7, dtype=torch.float64)[:, None]
    with torch.no_grad():
        expected = _scores_by_hand(head, F)
        torch.testing.assert_close(head(F), expected, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(head.importance(F), expected.exp(), rtol=1e-10, atol=0)
    assert expected.std(-1).min() > 1e-3  # the tokens get different scores: the check sees the attention


def test_scores_shape_and_bad_input():
    head = ImportanceHead(12, hidden=16, heads=2)
    assert head(torch.randn(3, 7, 12)).shape == (3, 7)
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
