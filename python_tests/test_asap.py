"""ASAP reconstructed from its abstract (strategy "asap"): against a loop-based reference written
here (dense matrices, one image at a time), each check shown to catch a deliberately broken
variant; the anchor always kept; ratio 0; LayerScale and register models; η, FLOPs, options."""

from __future__ import annotations

import warnings

import pytest
import torch

import pullback_ext.patch as patch
from helpers.blocks import matches_reference, small_timm, tokens_after_each_block
from helpers.originals_reference import asap_reference
from helpers.prune import images, tiny_dinov2, tiny_eva, tiny_vit
from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods import asap
from pullback_ext.comparison.cost import count_flops
from pullback_ext.prune.eta import eta, patch_tokens_per_block
from pullback_ext.prune.reduction_options import ReductionOptions


def _sink_removable(monkeypatch):
    def background(d, sink, num_prefix, count):
        far = d.clone()
        far[:, :num_prefix] = float("inf")
        return torch.argsort(far, dim=1, stable=True)[:, :count]

    monkeypatch.setattr(asap, "background", background)


def _no_lazy_walk(monkeypatch):
    monkeypatch.setattr(asap, "ALPHA", 0.0)


def _uniform_pooling(monkeypatch):
    monkeypatch.setattr(asap, "pooling_weights", lambda t, sink, dtype: torch.ones(t.shape[:2], dtype=dtype))


def _rings_by_position(monkeypatch):
    merges = asap.ring_merges
    monkeypatch.setattr(asap, "ring_merges", lambda members, rings: merges(members.sort(dim=1).values, rings))


BROKEN = {"sink_removable": _sink_removable, "no_lazy_walk": _no_lazy_walk, "uniform_pooling": _uniform_pooling,
          "rings_by_position": _rings_by_position}
PRUNE_BROKEN = ("sink_removable", "no_lazy_walk")


@pytest.mark.parametrize("mode,broken", [("merge", None), *[("merge", b) for b in BROKEN], ("prune", None),
                                         *[("prune", b) for b in PRUNE_BROKEN]])
def test_asap_matches_the_reference_and_the_check_catches_broken_variants(mode, broken, monkeypatch):
    model = tiny_vit(reg_tokens=1, depth=5).double()
    x = images(2).double()
    sinks = []
    expected, expected_blocks = asap_reference(model, x, layer=2, ratio=0.5, rings=3, mode=mode, sinks=sinks)
    assert any(s >= 2 for s in sinks)  # a patch-token sink, which the broken "sink_removable" would remove
    if broken:
        BROKEN[broken](monkeypatch)
    patch.timm(model, strategy="asap", ratio=0.5, layers=2, rings=3, mode=mode)
    assert matches_reference(model, x, expected, expected_blocks, 2) == (broken is None)


@pytest.mark.parametrize("llf", [False, "full"])
def test_prune_mode_with_and_without_last_layer_fusion(llf):
    model = tiny_vit(depth=4).double()
    x = images(2).double()
    expected, expected_blocks = asap_reference(model, x, layer=1, ratio=0.4, mode="prune", llf=llf)
    patch.timm(model, strategy="asap", ratio=0.4, layers=1, mode="prune", llf=llf)
    assert matches_reference(model, x, expected, expected_blocks, 1)


def test_one_ring_and_rings_clipped_to_the_room_left():
    model = tiny_vit(depth=4).double()
    x = images(2).double()
    for rings, ratio in ((1, 0.5), (6, 0.75)):  # 12 of 16 removed: 3 tokens besides the sink, so 3 rings
        expected, expected_blocks = asap_reference(model, x, layer=1, ratio=ratio, rings=rings)
        patch.timm(model, strategy="asap", ratio=ratio, layers=1, rings=rings)
        assert matches_reference(model, x, expected, expected_blocks, 1)


@pytest.mark.parametrize("reg_tokens,mode", [(0, "merge"), (2, "merge"), (0, "prune"), (2, "prune")])
def test_the_anchor_is_always_kept(reg_tokens, mode, monkeypatch):
    """At the largest ratio each mode allows, over many images, the sink survives as itself."""
    reduce, seen = asap.reduce, []

    def checked(state, attentions, count, options):
        sink, _ = asap.sink_distances(asap.lazy_walk(attentions, asap.ALPHA))
        out = reduce(state, attentions, count, options)
        for b in range(state.x.shape[0]):
            at = (out.positions[b] == sink[b]).nonzero()
            assert at.numel() == 1 and float(out.sizes[b, at[0, 0]]) == 1.0
            seen.append(int(sink[b]) >= state.num_prefix)
        return out

    monkeypatch.setattr(asap, "reduce", checked)
    model = tiny_vit(reg_tokens=reg_tokens, depth=4)
    x = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    ratio = 14 / 16 if mode == "merge" else 15 / 16  # the sink and one ring token / the sink stay
    patch.timm(model, strategy="asap", ratio=ratio, layers=2, mode=mode, llf=False)
    assert tokens_after_each_block(model, x)[-1] == 1 + reg_tokens + 16 - round(ratio * 16)
    assert len(seen) == 12 and any(seen)  # patch-token sinks among them


def test_ratio_zero_is_the_unpatched_model_bit_for_bit():
    model = tiny_vit(reg_tokens=1)
    x = images(2)
    plain, (plain_final, plain_inter) = model.forward_features(x), model.forward_intermediates(x, indices=[0, 2, 3])
    for mode in ("merge", "prune"):
        patch.timm(model, strategy="asap", ratio=0.0, layers=2, mode=mode)
        assert torch.equal(model.forward_features(x), plain)
        final, inter = model.forward_intermediates(x, indices=[0, 2, 3])
        assert torch.equal(final, plain_final) and all(torch.equal(a, b) for a, b in zip(inter, plain_inter))
    patch.unpatch(model)
    assert torch.equal(model.forward_features(x), plain)


@pytest.mark.parametrize("name,size", [("vit_small_patch14_dinov2", 56), ("vit_small_patch14_reg4_dinov2", 56)])
def test_layer_scale_and_register_models(name, size):
    """The reference applies ls1 / ls2; registers are never background; both modes."""
    model = small_timm(name, size)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    p = model.num_prefix_tokens
    for mode, layer in (("merge", 2), ("prune", 1)):
        expected, expected_blocks = asap_reference(model, x, layer=layer, ratio=0.5, rings=2, mode=mode)
        patch.timm(model, strategy="asap", ratio=0.5, layers=layer, rings=2, mode=mode)
        assert matches_reference(model, x, expected, expected_blocks, p)


def test_batch_rows_are_independent_and_dense_readers_get_pooled_tokens():
    model = tiny_vit(reg_tokens=1)
    x = images(3)
    patch.timm(model, strategy="asap", ratio=0.5, layers=1, rings=2)
    torch.testing.assert_close(model.forward_features(x), torch.cat([model.forward_features(x[i:i + 1]) for i in range(3)]),
                               rtol=1e-5, atol=1e-5)
    grid = model.forward_intermediates(x, indices=[3], intermediates_only=True)[0]
    assert grid.shape == (3, 32, 4, 4)
    assert len(torch.unique(grid.flatten(2).transpose(1, 2)[0], dim=0)) == 6 + 2  # 6 kept; 10 pooled into 2 ring tokens


@pytest.mark.parametrize("mode,llf", [("merge", "masked"), ("prune", "masked"), ("prune", False)])
def test_token_counts_and_eta(mode, llf):
    model = tiny_vit(reg_tokens=1)
    patch.timm(model, strategy="asap", ratio=0.3, layers=2, mode=mode, llf=llf)
    options = patch.config(model)
    counts = patch_tokens_per_block(options, model)
    assert counts == [16, 16, 11, 16 if (mode == "prune" and llf) else 11]  # round(0.3 · 16) = 5, net of ring tokens
    assert [c - 2 for c in tokens_after_each_block(model, images(2))] == counts
    assert eta(options, model) == 5 / 16


def _block_flops(tokens: int, dim: int = 32, hidden: int = 128) -> int:
    """FLOPs of one ViT block on ``tokens`` tokens, per image."""
    return 2 * tokens * dim * 3 * dim + 4 * tokens * tokens * dim + 2 * tokens * dim * dim + 4 * tokens * dim * hidden


def test_flop_counter_counts_the_patched_forward():
    """FLOPs = unpatched − what the smaller set saves + the attention read before the stage (qkv
    and logits) and the walk's products."""
    model = tiny_vit()
    x = images(1)
    plain = count_flops(model.forward_features, x)
    patch.timm(model, strategy="asap", ratio=0.5, layers=2)  # 17 tokens -> 9 at block 2
    read = 2 * 17 * 32 * 3 * 32 + 2 * 17 * 17 * 32  # qkv and q kᵀ of one block
    walk = 2 * 17 ** 3  # one P @ T per block before the stage
    expected = plain - 2 * _block_flops(17) + 2 * _block_flops(9) + 2 * (read + walk)
    assert count_flops(model.forward_features, x) == expected < plain


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rings=0), "rings must be an int >= 1"),
        (dict(rings=2.5), "rings must be an int >= 1"),
        (dict(rings=True), "rings must be an int >= 1"),
        (dict(layers=(1, 2)), "strategy 'asap' reduces in a single shot: layers must name one block"),
        (dict(layers=0), "layers must be 1 or later"),
        (dict(layers=4), r"layers must lie in \[0, 3\] for this 4-block model"),
        (dict(layers=3, mode="prune"), r"layers must lie in \[0, 2\] for this 4-block model \(with LLF"),
        (dict(ratio=0.95), "ratio 0.95 removes 15 of 16 patch tokens; at most 14 can go"),
        (dict(ratio=0.99, mode="prune"), "ratio 0.99 removes 16 of 16 patch tokens; at most 15 can go"),
        (dict(head=abs), "strategy 'asap' does not take head; it takes ratio, layers, mode, llf, prop_attn, rings"),
        (dict(weights="size"), "strategy 'asap' does not take weights"),
        (dict(matching="cosine"), "strategy 'asap' does not take matching"),
        (dict(selection="lowest"), "strategy 'asap' does not take selection"),
        (dict(r=2), "r is an option of strategy 'tome'"),
    ],
)
def test_invalid_asap_options_name_the_field(kwargs, match):
    options = dict(layers=2) | kwargs
    with pytest.raises(PullbackError, match=match):
        patch.timm(tiny_vit(), strategy="asap", **options)(images(1))


def test_options_round_trip_and_what_refuses_it():
    options = ReductionOptions(strategy="asap", ratio=0.4, layers=[3], rings=2, mode="prune", llf=False)
    assert ReductionOptions.from_dict(options.to_dict()) == options
    resolved = patch.config(patch.timm(tiny_vit(), strategy="asap", layers=2))
    assert (resolved.mode, resolved.prop_attn, resolved.rings, resolved.ratio) == ("merge", True, 4, 0.3)
    with pytest.raises(PullbackError, match="rings is an option of strategy 'asap'"):
        ReductionOptions(strategy="asap_score", rings=2)
    assert patch.config(patch.hf_dinov2(tiny_dinov2(), strategy="asap", layers=2)).mode == "merge"
    assert patch.config(patch.timm(tiny_eva(), strategy="asap", layers=2)).mode == "merge"  # RoPE: see test_rope_originals


def test_using_asap_warns_of_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ReductionOptions(strategy="asap", layers=3)
        ReductionOptions(strategy="asap_score")
