"""EViT as its authors run it (strategy "evit"): against a loop-based reference written here, each
check shown to catch a deliberately broken variant; LayerScale and register models; stages, η,
FLOPs, options."""

from __future__ import annotations

import itertools

import pytest
import torch

import pullback_ext.patch as patch
from helpers.blocks import embed, small_timm, tokens_after_each_block
from helpers.originals_reference import evit_reference
from helpers.prune import images, tiny_vit
from pullback_ext.errors import PullbackError
from pullback_ext.prune import timm_vit
from pullback_ext.prune.methods import evit
from pullback_ext.comparison.cost import count_flops
from pullback_ext.prune.eta import eta, patch_tokens_per_block
from pullback_ext.prune.pipeline import run_blocks
from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions


def _previous_block_attention(monkeypatch, model, stages):
    """Rank by the class token's attention in the block *before* each stage (the single-stage
    score's rule) instead of the stage's own block."""
    inputs = {}
    for j in (s - 1 for s in stages):  # the blocks before the stages run whole: their input is seen
        model.blocks[j].register_forward_pre_hook(lambda m, args, j=j: inputs.__setitem__(j, args[0]))
    previous = itertools.cycle([s - 1 for s in stages])

    def attention_of_previous_block(attended):
        j = next(previous)
        return timm_vit.attention_probs(model.blocks[j], inputs[j], None)[:, 0]

    monkeypatch.setattr(evit, "cls_attention", attention_of_previous_block)


def _unweighted_fuse(monkeypatch, model, stages):
    monkeypatch.setattr(evit, "fused_token", lambda x, a, mask: (x * mask[..., None]).sum(1, keepdim=True) / mask.sum(1)[:, None, None])


BROKEN = {"previous_block_attention": _previous_block_attention, "unweighted_fuse": _unweighted_fuse}


@pytest.mark.parametrize("broken", [None, *BROKEN])
def test_evit_matches_the_reference_and_the_check_catches_broken_variants(broken, monkeypatch):
    model = tiny_vit(reg_tokens=1, depth=5).double()
    x = images(2).double()
    stages = (1, 3)
    expected, expected_blocks = evit_reference(model, x, keep_rate=0.6, stages=stages)
    if broken:
        BROKEN[broken](monkeypatch, model, stages)
    patch.timm(model, strategy="evit", keep_rate=0.6, evit_layers=stages)
    got = model.forward_features(x)
    _, blocks = model.forward_intermediates(x, indices=list(range(5)), output_fmt="NLC")
    matches = torch.allclose(got, expected, rtol=1e-9, atol=1e-9) and all(
        torch.allclose(a, b[:, 2:], rtol=1e-9, atol=1e-9) for a, b in zip(blocks, expected_blocks))
    assert matches == (broken is None)


@pytest.mark.parametrize("name,size", [("vit_small_patch14_dinov2", 56), ("deit3_small_patch16_224", 64),
                                       ("vit_small_patch14_reg4_dinov2", 56)])
def test_layer_scale_and_register_models(name, size):
    """keep_rate = 1 is the unpatched model bit for bit; below 1 it is the reference that applies
    ls1 / ls2; unpatching restores bit-identical outputs."""
    model = small_timm(name, size)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    plain = model.forward_features(x)
    patch.timm(model, strategy="evit", keep_rate=1.0, evit_layers=(1, 2))
    assert torch.equal(model.forward_features(x), plain)
    patch.timm(model, strategy="evit", keep_rate=0.6, evit_layers=(1, 2))
    expected, _ = evit_reference(model, x, keep_rate=0.6, stages=(1, 2))
    torch.testing.assert_close(model.forward_features(x), expected, rtol=1e-9, atol=1e-9)
    patch.unpatch(model)
    assert torch.equal(model.forward_features(x), plain)


def test_default_stages_are_the_4th_7th_and_10th_of_12_blocks_scaled():
    assert evit.default_layers(12) == (3, 6, 9)
    assert patch.config(patch.timm(tiny_vit(depth=6), strategy="evit", keep_rate=0.7)).evit_layers == (1, 2, 4)
    with pytest.raises(PullbackError, match="evit_layers: EViT's blocks 3, 6, 9 of 12 do not scale"):
        patch.timm(tiny_vit(depth=4), strategy="evit", keep_rate=0.7)



def test_token_counts_and_eta_the_fused_token_counted_as_removed():
    model = tiny_vit(reg_tokens=2, depth=6)
    patch.timm(model, strategy="evit", keep_rate=0.5)  # stages (1, 2, 4): 16 -> 8 -> 4 -> 2 patch tokens
    options = patch.config(model)
    counts = patch_tokens_per_block(options, model)
    assert counts == [16, 8, 4, 4, 2, 2]
    seen = tokens_after_each_block(model, images(2))
    assert seen == [3 + c + (1 if i >= 1 else 0) for i, c in enumerate(counts)]  # prefix, patches, fused token
    assert eta(options, model) == 14 / 16
    assert eta(ReductionOptions(strategy="evit", keep_rate=0.7, evit_layers=(1,)), tiny_vit()) == 4 / 16  # ceil(11.2)


def test_flop_counter_counts_the_patched_forward():
    """FLOPs = unpatched − what the smaller sets save + the class-token row and the fusion."""
    model = tiny_vit()
    x = images(1)
    plain = count_flops(model.forward_features, x)
    patch.timm(model, strategy="evit", keep_rate=0.5, evit_layers=(1, 2))  # 17 -> 10 -> 6 tokens (CLS, fused)
    d, hidden = 32, 128

    def block(before, after):
        return 2 * before * d * 3 * d + 4 * before * before * d + 2 * before * d * d + 4 * after * d * hidden

    def stage_extra(tokens):  # the class token's logits over all heads (2 K hd each) and Σ a_i x_i
        return 2 * tokens * d + 2 * tokens * d

    expected = plain - 4 * block(17, 17) + block(17, 17) + block(17, 10) + block(10, 6) + block(6, 6)
    assert count_flops(model.forward_features, x) == expected + stage_extra(17) + stage_extra(10)


def test_batch_rows_are_independent():
    model = tiny_vit(reg_tokens=1)
    x = images(3)
    patch.timm(model, strategy="evit", keep_rate=0.6, evit_layers=(1, 2))
    torch.testing.assert_close(model.forward_features(x), torch.cat([model.forward_features(x[i:i + 1]) for i in range(3)]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(), r"needs keep_rate= \(fraction of patch tokens kept\)"),
        (dict(keep_rate=0.0), r"keep_rate must be None or a float in \(0, 1\]"),
        (dict(keep_rate=1.5), r"keep_rate must be None or a float in \(0, 1\]"),
        (dict(keep_rate="0.5"), r"keep_rate must be None or a float in \(0, 1\]"),
        (dict(keep_rate=0.5, evit_layers=(4,)), r"evit_layers must lie in \[0, 3\] for this 4-block model"),
        (dict(keep_rate=0.5, evit_layers=(2, 1)), "evit_layers must be strictly increasing"),
        (dict(keep_rate=0.5, evit_layers=(1,), prop_attn=True), "EViT runs its attention unchanged"),
        (dict(keep_rate=0.5, evit_layers=(1,), r=2), "r is an option of strategy 'tome'"),
        (dict(keep_rate=0.5, evit_layers=(1,), head=abs), "strategy 'evit' does not take head"),
    ],
)
def test_invalid_evit_options_name_the_field(kwargs, match):
    with pytest.raises(PullbackError, match=match):
        patch.timm(tiny_vit(), strategy="evit", **kwargs)


def test_evit_needs_a_class_token_and_a_backbone_that_splits_its_blocks():
    with pytest.raises(PullbackError, match="needs a class token"):
        patch.timm(tiny_vit(class_token=False), strategy="evit", keep_rate=0.5, evit_layers=(1,))
    model = tiny_vit()
    reduction = ReductionOptions(strategy="evit", keep_rate=0.5, evit_layers=(1,)).resolve(
        BackboneShape(depth=4, num_prefix=1, has_cls=True))
    with pytest.raises(PullbackError, match="cannot split its blocks"):
        run_blocks(reduction, embed(model, images(1)), model.blocks, timm_vit.call_block, timm_vit.attention_probs)
