"""ALGM as its authors run it (strategy "algm"): against the float64 loop reference of
helpers/algm_reference.py on timm models and Hugging Face families, each check shown to catch a
deliberately broken variant; the local pooling on hand-made tokens (order, destinations, the
count shared by the batch); nothing reduced is the unpatched model; token counts, η, options."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import pullback_ext.patch as patch
from helpers.algm_reference import algm_reference, local_similarities
from helpers.blocks import assert_zero_reduction_is_unpatched, matches_reference, small_timm, tokens_after_each_block
from helpers.broken_merges import unweighted_averages
from helpers.prune import images, tiny_vit
from pullback_ext.comparison.cost import count_flops
from pullback_ext.errors import PullbackError
from pullback_ext.prune.eta import eta, patch_tokens_per_block
from pullback_ext.prune.merged_tokens import MergedTokens
from pullback_ext.prune.methods import algm, merging
from pullback_ext.prune.methods.base import BackboneShape
from pullback_ext.prune.reduction_options import ReductionOptions


def pooling_threshold(sims: list, count: int) -> float:
    """A threshold at which the smallest count over the batch of windows at or above it is
    ``count``: the least, over the images, of the midpoint between its ``count``-th and next most
    similar window (far from every similarity, so rounding decides nothing)."""
    cuts = []
    for per_image in sims:
        ranked = sorted(per_image, reverse=True)
        cuts.append((ranked[count - 1] + ranked[count]) / 2)
    return min(cuts)


# deliberately broken variants: each must make the reference check fail

def _with_step(monkeypatch, change):
    rank = algm.ALGM.rank
    monkeypatch.setattr(algm.ALGM, "rank", lambda self, step: rank(self, change(step)))


def _keys_as_features(monkeypatch):
    _with_step(monkeypatch, lambda step: step._replace(state=step.state.with_x(step.attended.k.mean(dim=1))))


def _self_pairs_in_the_window_mean(monkeypatch):
    def with_self(unit, windows):
        grouped = unit[:, windows]
        return (grouped @ grouped.transpose(-1, -2)).mean(dim=(-1, -2))

    monkeypatch.setattr(algm, "window_similarity", with_self)


def _pooled_windows_in_grid_order(monkeypatch):
    """The pooled windows by their place in the grid, not most similar first."""
    local = algm.local_matching

    def by_place(x, num_prefix, window, threshold):
        m = local(x, num_prefix, window, threshold)
        if m is None:
            return m
        size, p = window[0] * window[1], num_prefix
        pooled = m.src.shape[1] // (size - 1) * size
        blocks = m.order[:, p:p + pooled].reshape(x.shape[0], -1, size)
        blocks = torch.gather(blocks, 1, blocks[:, :, :1].argsort(dim=1).expand(-1, -1, size))
        return merging.Matching(torch.cat([m.order[:, :p], blocks.flatten(1), m.order[:, p + pooled:]], dim=1), m.src, m.dst)

    monkeypatch.setattr(algm, "local_matching", by_place)


def _largest_count_of_the_batch(monkeypatch):
    monkeypatch.setattr(algm, "shared_count", lambda passed: int(passed.sum(dim=1).max()))


def _threshold_without_the_divisor(monkeypatch):
    threshold = algm.adaptive_threshold
    monkeypatch.setattr(algm, "adaptive_threshold", lambda best, layer_number: threshold(best, 1))


def _zero_based_divisor(monkeypatch):
    threshold = algm.adaptive_threshold
    monkeypatch.setattr(algm, "adaptive_threshold", lambda best, layer_number: threshold(best, layer_number - 1))


def _per_image_threshold(monkeypatch):
    monkeypatch.setattr(algm, "adaptive_threshold",
                        lambda best, layer_number: (best.mean(dim=1) + best.std(dim=1) / layer_number)[:, None])


def _global_merging_in_the_first_block_too(monkeypatch):
    monkeypatch.setattr(algm, "local_matching", lambda x, num_prefix, window, threshold: algm.global_matching(x, num_prefix, 1))


BROKEN = {
    "keys_as_features": _keys_as_features, "self_pairs_in_the_window_mean": _self_pairs_in_the_window_mean,
    "pooled_windows_in_grid_order": _pooled_windows_in_grid_order,
    "largest_count_of_the_batch": _largest_count_of_the_batch,
    "threshold_without_the_divisor": _threshold_without_the_divisor, "zero_based_divisor": _zero_based_divisor,
    "per_image_threshold": _per_image_threshold,
    "global_merging_in_the_first_block_too": _global_merging_in_the_first_block_too, "no_size_weights": unweighted_averages,
}


def grid_vit(depth: int = 5):
    """A float64 ViT with CLS and one register on 64×64 images, patch 8: an 8×8 grid of patch
    tokens (16 windows of 2×2), enough tokens that every rule of the global step shows."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=64, patch_size=8, embed_dim=32, depth=depth, num_heads=2, num_classes=0,
                              reg_tokens=1, no_embed_class=True)
    with torch.no_grad():
        for p in (model.pos_embed, model.cls_token, model.reg_token):
            p.normal_(0.0, 0.5)
    return model.double().eval().requires_grad_(False)


def grid_images(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 64, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


CASES = [(None, (0, 2)), (None, (1, 3)), (None, (0, 2, 3))] + [(b, (0, 2)) for b in BROKEN]


@pytest.mark.parametrize("broken,layers", CASES)
def test_algm_matches_the_reference_and_the_check_catches_broken_variants(broken, layers, monkeypatch):
    """64 patch tokens on an 8×8 grid, 2×2 windows, a threshold at which five windows pool (the
    smallest count of the three images), then the adaptive global merging."""
    model, x = grid_vit(), grid_images(3)
    threshold = pooling_threshold(local_similarities(model, x, layers[0]), 5)
    expected, expected_blocks = algm_reference(model, x, layers, threshold)
    plain = model.forward_features(x)
    assert not torch.allclose(expected, plain, atol=1e-4)  # the reference merges
    if broken:
        BROKEN[broken](monkeypatch)
    patch.timm(model, strategy="algm", local_threshold=threshold, algm_layers=layers)
    assert matches_reference(model, x, expected, expected_blocks) == (broken is None)
    if broken is None:
        counts = [c - 2 for c in tokens_after_each_block(model, x)]
        assert counts[:layers[0]] == [64] * layers[0] and counts[layers[0]] == 49 and counts[layers[1]] < 49


def test_the_adaptive_threshold_is_the_batch_mean_plus_the_mean_sample_std_over_the_block_number():
    """``global_merge.py:50``: ``mean_b(mean_j s) + mean_b(std_j s) / l``, ``std`` with n − 1."""
    best = torch.tensor([[0.2, 0.4, 0.9], [0.5, 0.5, 0.8]], dtype=torch.float64)
    means, stds = [0.5, 0.6], [(0.09 + 0.01 + 0.16) ** 0.5 / 2 ** 0.5, (0.01 + 0.01 + 0.04) ** 0.5 / 2 ** 0.5]
    want = sum(means) / 2 + sum(stds) / 2 / 5
    assert float(algm.adaptive_threshold(best, 5)) == pytest.approx(want, abs=1e-15)


def test_the_authors_default_threshold_matches_the_reference():
    model = tiny_vit(depth=5).double()
    x = images(2).double()
    expected, expected_blocks = algm_reference(model, x, (0, 1))
    patch.timm(model, strategy="algm")
    assert patch.config(model).algm_layers == (0, 1) and patch.config(model).local_threshold == 0.88
    assert matches_reference(model, x, expected, expected_blocks)


def test_with_proportional_attention_the_blocks_add_log_sizes_as_in_the_reference():
    model = tiny_vit(depth=5).double()
    x = images(2).double()
    threshold = pooling_threshold(local_similarities(model, x, 0), 1)
    expected, expected_blocks = algm_reference(model, x, (0, 2), threshold, prop_attn=True)
    patch.timm(model, strategy="algm", local_threshold=threshold, algm_layers=(0, 2), prop_attn=True)
    assert matches_reference(model, x, expected, expected_blocks)
    patch.timm(model, strategy="algm", local_threshold=threshold, algm_layers=(0, 2))
    assert not matches_reference(model, x, expected, expected_blocks)


LAYER_SCALE_MODELS = [("vit_small_patch14_reg4_dinov2", 56), ("deit3_small_patch16_224", 64)]


@pytest.mark.parametrize("name,size", LAYER_SCALE_MODELS)
def test_layer_scale_and_register_models(name, size):
    """A threshold above 1 at the one local block is the unpatched model bit for bit; below it
    the reference that applies ls1 / ls2."""
    model = small_timm(name, size)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    plain = assert_zero_reduction_is_unpatched(model, x, patch.timm, strategy="algm", local_threshold=1.5, algm_layers=(1,))
    threshold = pooling_threshold(local_similarities(model, x, 0), 2)
    patch.timm(model, strategy="algm", local_threshold=threshold, algm_layers=(0, 1))
    expected, blocks = algm_reference(model, x, (0, 1), threshold)
    assert matches_reference(model, x, expected, blocks)
    patch.unpatch(model)
    assert torch.equal(model.forward_features(x), plain)


def test_nothing_reduced_is_the_unpatched_model():
    model = tiny_vit(reg_tokens=1, depth=5).double()
    assert_zero_reduction_is_unpatched(model, images(2).double(), patch.timm, strategy="algm", local_threshold=1.01,
                                       algm_layers=(0,))


# Hugging Face families: the reference on timm blocks with the same weights

HF_CASES = [("dinov2", None), ("siglip", None), ("dinov2", "keys_as_features"), ("dinov2", "largest_count_of_the_batch"),
            ("siglip", "threshold_without_the_divisor"), ("siglip", "pooled_windows_in_grid_order")]


@pytest.mark.parametrize("family,broken", HF_CASES)
def test_a_hugging_face_family_matches_the_reference_on_timm_blocks_with_the_same_weights(family, broken, monkeypatch):
    """DINOv2 (CLS, 2 registers, LayerScale) and SigLIP (no prefix token): every layer output is
    the reference's, merged tokens given back to their positions; a threshold above 1 at the one
    local block is the unpatched model."""
    from helpers.hf_stand_ins import PATCHES, hidden_states, timm_stand_in, tiny

    model, x = tiny(family), images(2).double()
    plain = hidden_states(model, x)
    stand_in = timm_stand_in(model, family)
    threshold = pooling_threshold(local_similarities(stand_in, plain[0], 0), 2)
    final, per_layer = algm_reference(stand_in, plain[0], (0, 2), threshold)
    if broken:
        BROKEN[broken](monkeypatch)
    PATCHES[family](model, strategy="algm", local_threshold=threshold, algm_layers=(0, 2))
    hidden = hidden_states(model, x)
    assert torch.equal(hidden[0], plain[0])
    close = [torch.allclose(got, want, rtol=1e-9, atol=1e-9) for got, want in zip(hidden[1:], per_layer)]
    assert all(close + [torch.allclose(hidden[-1], final, rtol=1e-9, atol=1e-9)]) == (broken is None)
    assert not torch.allclose(hidden[-1], plain[-1], atol=1e-4)
    monkeypatch.undo()
    PATCHES[family](model, strategy="algm", local_threshold=1.5, algm_layers=(0,))
    assert all(torch.equal(a, b) for a, b in zip(hidden_states(model, x), plain))


# the local pooling on hand-made tokens

def _hand_made(second_passes: bool) -> torch.Tensor:
    """Two images of CLS + a 4×4 grid: window 3 (tokens 10, 11, 14, 15) identical tokens, window 1
    (2, 3, 6, 7) nearly so in the first image (and in the second when ``second_passes``), windows 0
    and 2 spread out."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 17, 8, generator=g, dtype=torch.float64)
    direction = torch.randn(8, generator=g, dtype=torch.float64)
    for image in range(2):
        x[image, 1 + torch.tensor([10, 11, 14, 15])] = direction
        if image == 0 or second_passes:
            x[image, 1 + torch.tensor([2, 3, 6, 7])] = 3.0 * direction + 0.3 * torch.randn(4, 8, generator=g, dtype=torch.float64)
    return x


def test_pooled_windows_come_first_most_similar_first_each_at_its_last_token():
    """The authors' order: ``[cls, window 3, window 1, the other tokens in order]``, each window's
    first three tokens merged into its last (``local_merge.py:97-114``)."""
    x = _hand_made(second_passes=True)
    sims = algm.window_similarity(torch.nn.functional.normalize(x[:, 1:], dim=-1), algm.window_tokens(4, (2, 2), "cpu"))
    assert (sims[:, 3] > sims[:, 1]).all() and (sims[:, 1] > 0.9).all() and (sims[:, [0, 2]] < 0.9).all()
    order, src, dst = algm.local_matching(x, 1, (2, 2), 0.9)
    pooled = [11, 12, 15, 16, 3, 4, 7, 8]
    assert order.tolist() == [[0] + pooled + [1, 2, 5, 6, 9, 10, 13, 14]] * 2
    assert src.tolist() == [[1, 2, 3, 5, 6, 7]] * 2 and dst.tolist() == [[4, 4, 4, 8, 8, 8]] * 2
    state = merging.apply_matching(MergedTokens(x=x, num_prefix=1), merging.Matching(order, src, dst))
    assert state.x.shape == (2, 11, 8)
    torch.testing.assert_close(state.x[:, 2], x[:, [3, 4, 7, 8]].mean(dim=1), rtol=1e-14, atol=1e-14)
    assert state.sizes[0].tolist() == [1.0, 4.0, 4.0] + [1.0] * 8
    assert state.positions[0].tolist()[:3] == [0, 16, 8]  # a pooled window at its last (bottom-right) token


def test_every_image_pools_the_smallest_count_of_the_batch():
    """Window 1 passes in the first image only: each image pools one window, its most similar."""
    x = _hand_made(second_passes=False)
    order, src, dst = algm.local_matching(x, 1, (2, 2), 0.9)
    assert src.shape == (2, 3) and order[:, 1:5].tolist() == [[11, 12, 15, 16]] * 2
    assert algm.local_matching(x, 1, (2, 2), 1.5) is None


# counts, η, FLOPs

def test_counts_depend_on_the_images_from_the_first_merging_block_on():
    model = tiny_vit(depth=5)
    options = ReductionOptions(strategy="algm", algm_layers=(1, 3))
    assert patch_tokens_per_block(options, model) == [16, None, None, None, None]
    assert eta(options, model) is None
    unreduced = ReductionOptions(strategy="algm", local_threshold=2.0, algm_layers=(1,))
    assert patch_tokens_per_block(unreduced, model) == [16] * 5 and eta(unreduced, model) == 0.0


def test_flops_drop_when_windows_pool():
    model = tiny_vit(reg_tokens=1, depth=5).double()
    x = images(1).double()
    plain = count_flops(model.forward_features, x)
    patch.timm(model, strategy="algm", local_threshold=2.0, algm_layers=(1,))
    assert count_flops(model.forward_features, x) == plain
    threshold = pooling_threshold(local_similarities(model, x, 1), 2)
    patch.timm(model, strategy="algm", local_threshold=threshold, algm_layers=(1, 3))
    assert count_flops(model.forward_features, x) < plain


# options

@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(local_threshold="0.9"), r"local_threshold must be a finite float >= -1"),
        (dict(local_threshold=float("nan")), r"local_threshold must be a finite float >= -1"),
        (dict(local_threshold=float("inf")), r"local_threshold must be a finite float >= -1"),
        (dict(local_threshold=-1.5), r"local_threshold must be a finite float >= -1"),
        (dict(local_threshold=True), r"local_threshold must be a finite float >= -1"),
        (dict(local_window=(0, 2)), r"local_window must be \(h, w\) ints >= 1"),
        (dict(local_window=1), r"local_window must be \(h, w\) ints >= 1 with at least 2 tokens"),
        (dict(local_window=(2,)), r"local_window must be \(h, w\) ints >= 1"),
        (dict(local_window="2"), r"local_window must be \(h, w\) ints >= 1"),
        (dict(local_window=(2, 2.0)), r"local_window must be \(h, w\) ints >= 1"),
        (dict(local_window=(3, 3)), r"local_window \(3, 3\) must tile the 4×4 patch grid"),
        (dict(algm_layers=(2, 1)), "algm_layers must be strictly increasing"),
        (dict(algm_layers=(1.5,)), r"algm_layers must be block indices \(ints\)"),
        (dict(algm_layers=(0, 4)), r"algm_layers must lie in \[0, 3\] for this 4-block model"),
        (dict(r=2), "r is an option of strategy .*'tome'.*; got strategy 'algm'"),
        (dict(ratio=0.5), "strategy 'algm' does not take ratio .* it takes local_threshold, local_window, algm_layers and prop_attn"),
        (dict(mode="prune"), "has no prune mode"),
    ],
)
def test_invalid_algm_options_name_the_field(kwargs, match):
    with pytest.raises(PullbackError, match=match):
        patch.timm(tiny_vit(), strategy="algm", **kwargs)


def test_a_model_too_shallow_to_scale_the_authors_blocks_is_told_to_give_them():
    with pytest.raises(PullbackError, match="algm_layers: ALGM's blocks 0 and 4 of 12 do not scale to this 2-block model"):
        patch.timm(tiny_vit(depth=2), strategy="algm")
    assert patch.config(patch.timm(tiny_vit(depth=2), strategy="algm", algm_layers=(0, 1))).algm_layers == (0, 1)


def test_algm_fields_need_algm():
    with pytest.raises(PullbackError, match="local_threshold is an option of strategy 'algm'; got strategy 'tome'"):
        ReductionOptions(strategy="tome", r=2, local_threshold=0.9)
    with pytest.raises(PullbackError, match="algm_layers is an option of strategy 'algm'; got strategy 'atc'"):
        ReductionOptions(strategy="atc", keep_rate=0.5, algm_layers=(1,))


def test_options_round_trip_resolve_to_the_authors_defaults_and_rows_name_the_rules():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options = ReductionOptions(strategy="algm", local_threshold=0.9, local_window=[2, 2], algm_layers=[0, 4])
    assert options.local_window == (2, 2) and options.algm_layers == (0, 4)
    assert ReductionOptions.from_dict(options.to_dict()) == options
    assert ReductionOptions(strategy="algm", local_window=2).local_window == (2, 2)
    shape = BackboneShape(depth=12, num_prefix=1, has_cls=True, num_patch=1024)
    resolved = ReductionOptions(strategy="algm").resolve(shape).options
    assert (resolved.algm_layers, resolved.local_threshold, resolved.local_window, resolved.prop_attn, resolved.mode) == (
        (0, 4), 0.88, (2, 2), False, "merge")
    assert ReductionOptions(strategy="algm").resolve(dataclasses.replace(shape, depth=24)).options.algm_layers == (0, 6)
    assert ReductionOptions(strategy="algm").resolve(dataclasses.replace(shape, depth=6)).options.algm_layers == (0, 2)
    reduction = ReductionOptions(strategy="algm").resolve(shape)
    row = algm.METHODS[0].describe(reduction)
    assert "2×2 windows" in row["selection"] and "0.88" in row["selection"] and "block 4" in row["selection"]
    assert "run frozen here" in row["selection"] and "fine-tune" in row["selection"]
    assert row["averaging"] == "size-weighted means; no proportional attention"
    with_prop = ReductionOptions(strategy="algm", prop_attn=True).resolve(shape)
    assert algm.METHODS[0].describe(with_prop)["averaging"] == "size-weighted means, proportional attention"
    with pytest.raises(PullbackError, match=r"local_window \(2, 2\) must tile the 15×15 patch grid"):
        ReductionOptions(strategy="algm").resolve(dataclasses.replace(shape, num_patch=225))
    with pytest.raises(PullbackError, match="strategy 'algm' pools windows of a square patch grid; got 200 patch tokens"):
        ReductionOptions(strategy="algm").resolve(dataclasses.replace(shape, num_patch=200))
