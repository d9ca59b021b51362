"""ToMe as its authors run it (strategy "tome"): against a loop-based reference written here, each
check shown to catch a deliberately broken variant; LayerScale and register models; schedules,
η, FLOPs, options."""

from __future__ import annotations

import warnings

import pytest
import torch

import pullback_ext.patch as patch
from helpers.blocks import assert_zero_reduction_is_unpatched, embed, small_timm, tokens_after_each_block
from helpers.prune import images, tiny_vit
from helpers.broken_merges import merges_everywhere, no_proportional_attention, unweighted_averages
from helpers.originals_reference import tome_reference
from pullback_ext.errors import PullbackError
from pullback_ext.prune import timm_vit
from pullback_ext.prune.methods import merging, tome
from pullback_ext.comparison.cost import count_flops
from pullback_ext.prune.eta import eta, patch_tokens_per_block
from pullback_ext.prune.pipeline import run_blocks
from pullback_ext.prune.reduction_options import ReductionOptions
from pullback_ext.prune.split_block import SplitBlock


def _features_as_keys(monkeypatch):
    rank = tome.ToMe.rank
    monkeypatch.setattr(tome.ToMe, "rank", lambda self, step: rank(self, step._replace(attended=step.attended._replace(k=step.state.x[:, None]))))


BROKEN = {"features_as_keys": _features_as_keys, "merges_outside_the_range": merges_everywhere,
          "no_size_weights": unweighted_averages, "no_proportional_attention": no_proportional_attention}


@pytest.mark.parametrize("broken", [None, *BROKEN])
def test_tome_matches_the_reference_and_the_check_catches_broken_variants(broken, monkeypatch):
    model = tiny_vit(reg_tokens=1, depth=5).double()
    x = images(2).double()
    expected, expected_blocks = tome_reference(model, x, merges=[0, 3, 3, 3, 0])
    if broken:
        BROKEN[broken](monkeypatch)
        monkeypatch.setattr(merging, "FUSED", False)  # the variants break the unfused path's pieces
    patch.timm(model, strategy="tome", r=3, block_range=(1, 4))
    final, blocks = model.forward_intermediates(x, indices=list(range(5)), output_fmt="NLC")
    matches = torch.allclose(model.forward_features(x), expected, rtol=1e-9, atol=1e-9) and all(
        torch.allclose(got, want[:, 2:], rtol=1e-9, atol=1e-9) for got, want in zip(blocks, expected_blocks))
    assert matches == (broken is None)


def test_tome_without_proportional_attention_matches_the_reference_without_it():
    model = tiny_vit(depth=4).double()
    x = images(2).double()
    expected, _ = tome_reference(model, x, merges=[4, 4, 4, 4], prop_attn=False)
    patch.timm(model, strategy="tome", r=4, prop_attn=False)
    torch.testing.assert_close(model.forward_features(x), expected, rtol=1e-9, atol=1e-9)


LAYER_SCALE_MODELS = [("vit_small_patch14_dinov2", 56), ("deit3_small_patch16_224", 64), ("vit_small_patch14_reg4_dinov2", 56)]


@pytest.mark.parametrize("name,size", LAYER_SCALE_MODELS)
def test_layer_scale_and_register_models(name, size, monkeypatch):
    """r = 0 is the unpatched model bit for bit; r > 0 is the reference that applies ls1 / ls2, and
    skipping them (ToMe's own timm patch) is caught."""
    model = small_timm(name, size)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert_zero_reduction_is_unpatched(model, x, patch.timm, strategy="tome", r=0)
    patch.timm(model, strategy="tome", r=4, schedule="decreasing")
    expected, _ = tome_reference(model, x, merges=merging.merges_per_block(4, "decreasing", 3))
    torch.testing.assert_close(model.forward_features(x), expected, rtol=1e-9, atol=1e-9)
    monkeypatch.setattr(timm_vit, "SPLIT", halves_without_layer_scale())
    assert not torch.allclose(model.forward_features(x), expected, rtol=1e-6, atol=1e-6)


def halves_without_layer_scale() -> SplitBlock:
    """The split halves of a block with ``ls1`` / ``ls2`` left out (what ToMe's own timm patch runs)."""

    def without(half):
        def run(block, *args):
            saved = block.ls1, block.ls2
            block.ls1, block.ls2 = torch.nn.Identity(), torch.nn.Identity()
            try:
                return half(block, *args)
            finally:
                block.ls1, block.ls2 = saved
        return run

    return SplitBlock(attend=without(timm_vit.attend), feed_forward=without(timm_vit.feed_forward))


def test_unpatch_restores_bit_identical_outputs():
    model = small_timm("vit_small_patch14_reg4_dinov2", 56)
    x = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    plain = model(x)
    patch.timm(model, strategy="tome", r=3)
    assert not torch.allclose(model(x), plain)
    patch.unpatch(model)
    assert torch.equal(model(x), plain)


def test_schedules():
    assert merging.merges_per_block(8, "constant", 4) == [8, 8, 8, 8]
    assert merging.merges_per_block(8, "decreasing", 5) == [16, 12, 8, 4, 0]
    assert merging.merges_per_block(16, "decreasing", 12) == [32, 29, 26, 23, 20, 17, 14, 11, 8, 5, 2, 0]
    assert merging.merges_per_block(5, "decreasing", 1) == [5]
    options = ReductionOptions(strategy="tome", r=2, schedule="decreasing", block_range=(1, 4))
    assert merging.block_merges(options, 6) == [0, 4, 2, 0, 0, 0]



@pytest.mark.parametrize("reg_tokens,r,schedule", [(0, 4, "constant"), (1, 5, "constant"), (2, 3, "decreasing"), (0, 40, "constant")])
def test_token_counts_and_eta_are_a_pure_function_of_the_schedule(reg_tokens, r, schedule):
    model = tiny_vit(reg_tokens=reg_tokens)
    patch.timm(model, strategy="tome", r=r, schedule=schedule)
    options, p = patch.config(model), 1 + reg_tokens
    counts = patch_tokens_per_block(options, model)
    assert [c - p for c in tokens_after_each_block(model, images(2))] == counts
    assert eta(options, model) == 1 - counts[-1] / 16
    assert counts[-1] >= 1  # r is clipped: the prefix tokens and at least one patch token remain
    assert eta(ReductionOptions(strategy="tome", r=4), tiny_vit()) == 14 / 16  # 16 -> 12 -> 8 -> 4 -> 2


def _block_flops(tokens: int, dim: int, hidden: int) -> tuple[int, int]:
    """(attention, MLP) FLOPs of one ViT block on ``tokens`` tokens, per image."""
    attention = 2 * tokens * dim * 3 * dim + 4 * tokens * tokens * dim + 2 * tokens * dim * dim
    return attention, 4 * tokens * dim * hidden


def test_flop_counter_counts_the_patched_forward():
    """FLOPs of the patched forward = unpatched − what the merges save + ToMe's matching."""
    model = tiny_vit(reg_tokens=1)
    x = images(1)
    plain = count_flops(model.forward_features, x)
    patch.timm(model, strategy="tome", r=3)
    counts = [2 + c for c in patch_tokens_per_block(patch.config(model), model)]
    expected, before = plain, 18
    for after in counts:
        attn_full, mlp_full = _block_flops(18, 32, 128)
        attn, _ = _block_flops(before, 32, 128)
        _, mlp = _block_flops(after, 32, 128)
        size_a = (before + 1) // 2 - 1
        expected += attn - attn_full + mlp - mlp_full + 2 * size_a * (before - 2 - size_a) * 16
        before = after
    assert count_flops(model.forward_features, x) == expected < plain
    plain_attention = count_flops(model.blocks[0], embed(model, x))
    for block in model.blocks:
        block.attn.fused_attn = False  # the counter sees fused and explicit attention alike
    assert count_flops(model.blocks[0], embed(model, x)) == plain_attention


def test_batch_rows_are_independent_and_dense_readers_get_unmerged_tokens():
    model = tiny_vit(reg_tokens=1)
    x = images(3)
    patch.timm(model, strategy="tome", r=4)
    batched = model.forward_features(x)
    single = torch.cat([model.forward_features(x[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-5)
    grid = model.forward_intermediates(x, indices=[3], intermediates_only=True)[0]
    assert grid.shape == (3, 32, 4, 4)
    assert len(torch.unique(grid.flatten(2).transpose(1, 2)[0], dim=0)) == 2  # 16 patches merged into 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(), r"needs r= \(tokens merged per block\)"),
        (dict(r=-1), "r must be None or an int >= 0"),
        (dict(r=2.5), "r must be None or an int >= 0"),
        (dict(r=2, schedule="increasing"), "schedule must be one of constant, decreasing"),
        (dict(r=2, block_range=(2, 2)), "block_range must be None or"),
        (dict(r=2, block_range=(1,)), "block_range must be None or"),
        (dict(r=2, block_range=(1, 5)), "block_range must end at or before block 4"),
        (dict(r=2, ratio=0.5), "strategy 'tome' does not take ratio"),
        (dict(r=2, layers=(2,)), "strategy 'tome' does not take layers"),
        (dict(r=2, mode="prune"), "has no prune mode"),
        (dict(r=2, keep_rate=0.5), "keep_rate is an option of strategy 'evit'"),
    ],
)
def test_invalid_tome_options_name_the_field(kwargs, match):
    model = tiny_vit()
    with pytest.raises(PullbackError, match=match):
        patch.timm(model, strategy="tome", **kwargs)
    with pytest.raises(PullbackError, match="r is an option of strategy 'tome'"):
        ReductionOptions(strategy="norm", r=2)


def test_options_round_trip_and_a_backbone_that_cannot_split_its_blocks_refuses_the_original():
    from helpers.prune import tiny_dinov2, tiny_hf

    options = ReductionOptions(strategy="tome", r=3, schedule="decreasing", block_range=[1, 3], prop_attn=False)
    assert options.block_range == (1, 3)
    assert ReductionOptions.from_dict(options.to_dict()) == options
    resolved = patch.config(patch.timm(tiny_vit(), strategy="tome", r=3))
    assert (resolved.block_range, resolved.prop_attn, resolved.mode) == ((0, 4), True, "merge")
    assert patch.config(patch.hf_dinov2(tiny_dinov2(), strategy="tome", r=2)).r == 2
    assert patch.config(patch.hf_dinov3(tiny_hf("dinov3"), strategy="tome", r=2)).r == 2  # RoPE: see test_rope_originals
    model = tiny_vit()
    with pytest.raises(PullbackError, match="strategy 'tome' reduces between attention and MLP.*cannot split its blocks"):
        run_blocks(options.resolve(timm_vit.backbone_shape(model)), embed(model, images(1)),
                   model.blocks, timm_vit.call_block, timm_vit.attention_probs)


def test_using_tome_warns_of_nothing():  # the user named the method; nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ReductionOptions(strategy="tome", r=2)
        patch.timm(tiny_vit(), strategy="tome", r=3)
        ReductionOptions(strategy="tome_score")
