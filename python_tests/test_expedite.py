"""Expedite (strategy "expedite"): against a loop-based reference written here (one image at a
time, one token and one centre at a time), each check shown to catch a deliberately broken
variant; the identity cases; the demo model's DPT hooks; LayerScale and register models; η,
FLOPs, options."""

from __future__ import annotations


import pytest
import torch

import pullback_ext.patch as patch
from helpers.blocks import attention_half, mlp_half, small_timm, tokens_after_each_block
from helpers.originals_reference import cluster_reference, expedite_reference, rebuild, reconstruction_reference
from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods import expedite
from pullback_ext.comparison.backbones import demo_backbone
from pullback_ext.comparison.cost import count_flops
from pullback_ext.prune.eta import eta, patch_tokens_per_block
from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions


def vit64(reg_tokens: int = 0, class_token: bool = True, depth: int = 4, img_size=64):
    """A float64 timm ViT on 64×64 images, patch 8: an 8×8 patch grid (+ CLS + registers)."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=img_size, patch_size=8, embed_dim=32, depth=depth, num_heads=2, num_classes=0,
                              reg_tokens=reg_tokens, class_token=class_token, no_embed_class=reg_tokens > 0,
                              global_pool="token" if class_token else "avg")
    with torch.no_grad():
        for name in ("pos_embed", "cls_token", "reg_token"):
            p = getattr(model, name, None)
            if p is not None:
                p.normal_(0.0, 0.5)
    return model.double().eval().requires_grad_(False)


def images64(n: int = 2, size: int = 64) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _global_assignment(monkeypatch):
    monkeypatch.setattr(expedite, "neighbourhood", lambda side, grid, window, device: torch.ones(
        side * side, grid[0] * grid[1], dtype=torch.bool, device=device))
    return {}


def _nearest_centre_copy(monkeypatch):
    weights = expedite.reconstruction_weights
    monkeypatch.setattr(expedite, "reconstruction_weights", lambda patches, centres, k, tau: weights(patches, centres, 1, tau))
    return {}


def _temperature_multiplies(monkeypatch):
    assign = expedite.assignment
    monkeypatch.setattr(expedite, "assignment", lambda d, allowed, tau: assign(d, allowed, 1.0 / tau))
    return {}


def _clustering_one_block_late(monkeypatch):
    return {"cluster_layer": 2}


BROKEN = {"global_assignment": _global_assignment, "nearest_centre_copy": _nearest_centre_copy,
          "temperature_multiplies": _temperature_multiplies, "clustering_one_block_late": _clustering_one_block_late}


@pytest.mark.parametrize("broken", [None, *BROKEN])
def test_expedite_matches_the_reference_and_the_check_catches_broken_variants(broken, monkeypatch):
    model, x = vit64(reg_tokens=1), images64(2)
    settings = dict(cluster_grid=(4, 4), cluster_layer=1, cluster_window=3, cluster_iters=3, cluster_tau=8.0, reconstruct_k=4)
    expected, expected_blocks = expedite_reference(model, x, grid=(4, 4), layer=1, window=3, iters=3, tau=8.0, k=4)
    overrides = BROKEN[broken](monkeypatch) if broken else {}
    patch.timm(model, strategy="expedite", **{**settings, **overrides})
    got = model.forward_features(x)
    _, blocks = model.forward_intermediates(x, indices=list(range(4)), output_fmt="NLC")
    assert got.shape == expected.shape and all(b.shape == (2, 64, 32) for b in blocks)
    matches = torch.allclose(got, expected, rtol=1e-9, atol=1e-9) and all(
        torch.allclose(a, b[:, 2:], rtol=1e-9, atol=1e-9) for a, b in zip(blocks, expected_blocks))
    assert matches == (broken is None)


def test_demo_model_dpt_hooks_read_reconstructed_tokens(random_demo_model):
    """The demo's depth head reads blocks 1, 3, 5, 7: block 1 (before the clustering layer 2) as it
    is, the others reconstructed; the head's output is the one of the reference's hooked tokens."""
    model = random_demo_model().double()
    images = torch.rand(1, 3, 112, 112, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    backbone = demo_backbone(model)
    shape = BackboneShape(depth=8, num_prefix=1, has_cls=True, dense_neck=True)
    reduction = ReductionOptions(strategy="expedite", cluster_grid=(7, 7), cluster_layer=2, cluster_tau=20.0).resolve(shape)
    got = backbone.reduced(reduction, images)
    bb = model.backbone
    x, recorded, hooked = model.embed(images)[0], None, {}
    for i, block in enumerate(bb.blocks):
        if i == 2:
            centres = cluster_reference(x[1:], (7, 7), 5, 5, 20.0)
            recorded = reconstruction_reference(x[1:], centres, 20, 20.0)
            x = torch.cat([x[:1], torch.stack(centres)])
        x = mlp_half(block, attention_half(block, x)[0])
        if i in model.hook_layers:
            hooked[i] = rebuild(x, 1, recorded)[None]
    expected = model.decode(hooked[7], hooked)
    torch.testing.assert_close(got["depth"], expected["depth"], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got["embedding"], expected["embedding"], rtol=1e-9, atol=1e-9)
    assert not torch.allclose(got["depth"], model(images)["depth"])


def test_as_many_clusters_as_patches_is_the_identity_without_iterations_or_as_tau_vanishes():
    model, x = vit64(reg_tokens=2), images64(2)
    plain = model.forward_features(x)
    patch.timm(model, strategy="expedite", cluster_grid=64, cluster_layer=1, cluster_iters=0, reconstruct_k=1)
    assert torch.equal(model.forward_features(x), plain)
    patch.timm(model, strategy="expedite", cluster_grid=64, cluster_layer=1, cluster_tau=1e-8, reconstruct_k=4)
    torch.testing.assert_close(model.forward_features(x), plain, rtol=1e-10, atol=1e-10)
    patch.timm(model, strategy="expedite", cluster_grid=64, cluster_layer=1)  # τ = 10: tokens average their neighbours
    assert not torch.allclose(model.forward_features(x), plain, rtol=1e-3, atol=1e-3)
    patch.unpatch(model)
    assert torch.equal(model.forward_features(x), plain)


@pytest.mark.parametrize("name,size", [("vit_small_patch14_dinov2", 112), ("deit3_small_patch16_224", 128),
                                       ("vit_small_patch14_reg4_dinov2", 112)])
def test_layer_scale_and_register_models(name, size):
    """The blocks run whole on the cluster tokens (ls1 / ls2 as the block applies them), prefix
    tokens kept: the reference with its explicit LayerScale factors; unpatching restores."""
    model = small_timm(name, size)
    x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    plain = model.forward_features(x)
    patch.timm(model, strategy="expedite", cluster_grid=16, cluster_tau=200.0)  # α = 1 of 3 blocks by default
    assert patch.config(model).cluster_layer == 1
    expected, _ = expedite_reference(model, x, grid=(4, 4), layer=1, tau=200.0)
    torch.testing.assert_close(model.forward_features(x), expected, rtol=1e-9, atol=1e-9)
    patch.unpatch(model)
    assert torch.equal(model.forward_features(x), plain)


def test_no_class_token_and_batch_rows_are_independent():
    model, x = vit64(class_token=False), images64(3)
    patch.timm(model, strategy="expedite", cluster_grid=(4, 2), cluster_layer=2)
    expected, _ = expedite_reference(model, x[:1], grid=(4, 2), layer=2)
    got = model.forward_features(x)
    torch.testing.assert_close(got[:1], expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got, torch.cat([model.forward_features(x[i:i + 1]) for i in range(3)]), rtol=1e-12, atol=1e-12)


def test_defaults_token_counts_and_eta():
    assert [expedite.default_layer(d) for d in (24, 12, 8, 4, 3, 2)] == [10, 5, 3, 2, 1, 1]
    options = ReductionOptions(strategy="expedite", cluster_grid=16)
    assert (options.cluster_iters, options.cluster_window, options.cluster_tau, options.reconstruct_k) == (5, 5, 10.0, 20)
    model = vit64(reg_tokens=1)
    patch.timm(model, strategy="expedite", cluster_grid=16)  # α = 2 of 4 blocks
    counts = patch_tokens_per_block(patch.config(model), model)
    assert counts == [64, 64, 16, 16]
    assert tokens_after_each_block(model, images64(1)) == [2 + c for c in counts]
    assert eta(patch.config(model), model) == 0.75
    assert eta(ReductionOptions(strategy="expedite", cluster_grid=(6, 4), cluster_layer=3), model) == 1 - 24 / 64
    assert eta(ReductionOptions(strategy="expedite", cluster_grid=(3, 3)), model, num_patches=36) == 0.75


def test_flop_counter_counts_the_patched_forward():
    """FLOPs = unpatched − what the cluster tokens save + κ (distances + centre update), the
    recorded distances, and the reconstruction of the final output."""
    model, x = vit64(), images64(1)
    plain = count_flops(model.forward_features, x)
    patch.timm(model, strategy="expedite", cluster_grid=16, cluster_layer=2, cluster_iters=3, reconstruct_k=6)
    d, hidden, n, m = 32, 128, 64, 16

    def block(k):
        return 2 * k * d * 3 * d + 4 * k * k * d + 2 * k * d * d + 4 * k * d * hidden

    clustering = 3 * (2 * n * m * d + 2 * n * m * d) + 2 * n * m * d
    expected = plain - 2 * block(65) + 2 * block(17) + clustering + 2 * n * 6 * d
    assert count_flops(model.forward_features, x) == expected


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(), r"needs cluster_grid= \(the \(h, w\) grid of cluster tokens, or their count\)"),
        (dict(cluster_grid=15), "cluster_grid must be None, \\(h, w\\) ints >= 1, or a square number"),
        (dict(cluster_grid=(0, 4)), "cluster_grid must be None, \\(h, w\\) ints >= 1"),
        (dict(cluster_grid=(2, 2, 2)), "cluster_grid must be None"),
        (dict(cluster_grid=4, cluster_layer=4), r"cluster_layer must lie in \[0, 3\] for this 4-block model"),
        (dict(cluster_grid=4, cluster_layer=-1), "cluster_layer must be None or an int >= 0"),
        (dict(cluster_grid=4, cluster_iters=-1), "cluster_iters must be an int >= 0"),
        (dict(cluster_grid=4, cluster_iters=1.5), "cluster_iters must be an int >= 0"),
        (dict(cluster_grid=4, cluster_window=4), "cluster_window must be an odd int >= 1"),
        (dict(cluster_grid=4, cluster_tau=0.0), "cluster_tau must be a finite float > 0"),
        (dict(cluster_grid=4, cluster_tau=float("inf")), "cluster_tau must be a finite float > 0"),
        (dict(cluster_grid=4, cluster_tau="1"), "cluster_tau must be a finite float > 0"),
        (dict(cluster_grid=4, reconstruct_k=0), "reconstruct_k must be an int >= 1"),
        (dict(cluster_grid=4, prop_attn=True), "Expedite runs its attention unchanged"),
        (dict(cluster_grid=4, mode="prune"), "strategy 'expedite' has no prune mode"),
        (dict(cluster_grid=4, r=2), "r is an option of strategy 'tome'"),
        (dict(cluster_grid=4, ratio=0.5), "strategy 'expedite' does not take ratio"),
    ],
)
def test_invalid_expedite_options_name_the_field(kwargs, match):
    with pytest.raises(PullbackError, match=match):
        patch.timm(vit64(), strategy="expedite", **kwargs)


def test_expedite_fields_need_strategy_expedite_and_a_square_grid_that_holds_the_clusters():
    with pytest.raises(PullbackError, match="cluster_iters is an option of strategy 'expedite'; got strategy 'tome'"):
        ReductionOptions(strategy="tome", r=2, cluster_iters=3)
    with pytest.raises(PullbackError, match="cluster_grid \\(9, 9\\) must fit in the 8×8 patch grid"):
        patch.timm(vit64(), strategy="expedite", cluster_grid=81).forward_features(images64(1))
    with pytest.raises(PullbackError, match="cluster_grid \\(9, 9\\) must fit in the 8×8 patch grid"):
        eta(ReductionOptions(strategy="expedite", cluster_grid=81), vit64())
    wide = vit64(img_size=(32, 64))
    with pytest.raises(PullbackError, match="needs a square patch grid; got 32 patch tokens"):
        patch.timm(wide, strategy="expedite", cluster_grid=4).forward_features(images64(1)[..., :32, :])
    options = ReductionOptions(strategy="expedite", cluster_grid=[3, 2])
    assert options.cluster_grid == (3, 2) and ReductionOptions.from_dict(options.to_dict()) == options
