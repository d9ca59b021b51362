"""ToFu as the comparisons in the field run it (strategy "tofu"): against the float64 loop reference
of ``helpers.tofu_reference`` on timm models (LayerScale, registers), Hugging Face ViT and SigLIP
layers and the RoPE backbones (DINOv3, Eva), each check shown to catch a deliberately broken
variant; MLERP itself; token counts, η, FLOPs, options; a whole graph under ``torch.compile``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pullback_ext.patch as patch
from helpers.blocks import assert_zero_reduction_is_unpatched, small_timm, tokens_after_each_block
from helpers.broken_merges import merges_everywhere
from helpers.host_sync import NoHostSync
from helpers.prune import images, tiny_vit
from helpers.tofu_reference import tofu_reference
from pullback_ext import ops
from pullback_ext.comparison.cost import count_flops
from pullback_ext.errors import PullbackError
from pullback_ext.prune.eta import eta, patch_tokens_per_block
from pullback_ext.prune.methods import merging, tofu
from pullback_ext.prune.methods.base import BackboneShape
from pullback_ext.prune.reduction_options import ReductionOptions
from pullback_ext.prune.row_rules import describe


def _rescaled_mean(x, sizes, src, dst, weights, by_average=False, with_destination=True):
    """A MLERP written another way: the mean under ``weights``, rescaled to the largest norm over the
    norm of the destination (or of the average)."""
    mean = ops.merge_tokens(x, weights, src, dst)[0]
    norms = x.norm(dim=-1)
    sources = torch.gather(norms, 1, src)
    largest = (norms if with_destination else torch.zeros_like(norms)).scatter_reduce(1, dst, sources, "amax")
    kept = tofu._kept(x, src)
    largest, own = torch.gather(largest, 1, kept), torch.gather(norms, 1, kept)
    merged = torch.zeros_like(norms).scatter(1, dst, 1.0).gather(1, kept) > 0
    scale = torch.where(merged, largest / (mean.norm(dim=-1) if by_average else own), 1.0)
    return mean * scale[..., None], tofu._added_sizes(sizes, src, dst)


def _plain_mean(x, sizes, src, dst):
    return ops.merge_tokens(x, torch.ones_like(sizes), src, dst)[0], tofu._added_sizes(sizes, src, dst)


def _replace(name, fn):
    return lambda monkeypatch: monkeypatch.setattr(tofu, name, fn)


def _features_as_keys(monkeypatch):
    rank = tofu.ToFu.rank
    monkeypatch.setattr(tofu.ToFu, "rank", lambda self, step: rank(self, step._replace(attended=step.attended._replace(k=step.state.x[:, None]))))


def _prefix_tokens_merged(monkeypatch):
    rank = tofu.ToFu.rank
    monkeypatch.setattr(tofu.ToFu, "rank", lambda self, step: rank(self, step._replace(state=dataclasses.replace(step.state, num_prefix=0))))


def _proportional_attention(monkeypatch):
    resolve = tofu.ToFu.resolve
    monkeypatch.setattr(tofu.ToFu, "resolve", lambda self, options, backbone: dict(resolve(self, options, backbone), prop_attn=True))


BROKEN = {
    "features_as_keys": _features_as_keys,
    "prefix_tokens_merged": _prefix_tokens_merged,
    "merges_outside_the_range": merges_everywhere,
    "merged_in_every_block": _replace("pruned", tofu.mlerp),
    "pruned_in_every_block": _replace("mlerp", tofu.pruned),
    "pruned_tokens_averaged": _replace("pruned", merging.size_weighted),
    "switch_one_block_late": _replace("default_merge_from", lambda depth: depth // 2 + 2),
    "plain_mean": _replace("mlerp", _plain_mean),
    "size_weighted_mlerp": _replace("mlerp", lambda x, s, src, dst: _rescaled_mean(x, s, src, dst, s)),
    "norm_of_the_average": _replace("mlerp", lambda x, s, src, dst: _rescaled_mean(x, s, src, dst, torch.ones_like(s),
                                                                                     by_average=True)),
    "largest_source_norm_only": _replace("mlerp", lambda x, s, src, dst: _rescaled_mean(x, s, src, dst, torch.ones_like(s),
                                                                                          with_destination=False)),
    "proportional_attention": _proportional_attention,
}


def _matches(model, x, expected, expected_blocks) -> bool:
    final, blocks = model.forward_intermediates(x, indices=list(range(len(model.blocks))), output_fmt="NLC")
    p = model.num_prefix_tokens
    return torch.allclose(model.forward_features(x), expected, rtol=1e-9, atol=1e-9) and all(
        torch.allclose(got, want[:, p:], rtol=1e-9, atol=1e-9) for got, want in zip(blocks, expected_blocks))


@pytest.mark.parametrize("broken", [None, *BROKEN])
def test_tofu_matches_the_reference_and_the_check_catches_broken_variants(broken, monkeypatch):
    """Depth 6: blocks 1, 2, 3 prune (merge_from = 4), blocks 4, 5 merge with MLERP."""
    model = tiny_vit(reg_tokens=1, depth=6).double()
    x = images(2).double()
    expected, expected_blocks = tofu_reference(model, x, merges=[0, 2, 2, 2, 2, 2])
    if broken:
        BROKEN[broken](monkeypatch)
    patch.timm(model, strategy="tofu", r=2, block_range=(1, 6))
    assert _matches(model, x, expected, expected_blocks) == (broken is None)


def test_merge_from_the_schedule_and_proportional_attention_match_the_reference():
    model = tiny_vit(depth=4).double()
    x = images(2).double()
    for merge_from in (0, 1, 4):
        patch.timm(model, strategy="tofu", r=3, merge_from=merge_from)
        assert _matches(model, x, *tofu_reference(model, x, merges=[3] * 4, merge_from=merge_from)), merge_from
    patch.timm(model, strategy="tofu", r=3, schedule="decreasing", prop_attn=True)
    merges = merging.merges_per_block(3, "decreasing", 4)
    assert _matches(model, x, *tofu_reference(model, x, merges=merges, prop_attn=True))
    assert not _matches(model, x, *tofu_reference(model, x, merges=merges, prop_attn=False))


LAYER_SCALE_MODELS = [("vit_small_patch14_dinov2", 56), ("deit3_small_patch16_224", 64), ("vit_small_patch14_reg4_dinov2", 56)]


@pytest.mark.parametrize("name,size", LAYER_SCALE_MODELS)
def test_layer_scale_and_register_models(name, size):
    """r = 0 is the unpatched model bit for bit; r > 0 is the reference that applies ls1 / ls2."""
    model = small_timm(name, size)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    plain = assert_zero_reduction_is_unpatched(model, x, patch.timm, strategy="tofu", r=0)
    patch.timm(model, strategy="tofu", r=4)  # 3 blocks: block 0, 1 prune, block 2 merges
    assert _matches(model, x, *tofu_reference(model, x, merges=[4, 4, 4]))
    patch.unpatch(model)
    assert torch.equal(model.forward_features(x), plain)


@pytest.mark.parametrize("family", ["vit", "siglip"])
def test_hugging_face_layers_match_the_reference_on_timm_blocks_with_the_same_weights(family):
    """Every layer output (full-length hidden states) is the reference's on timm blocks carrying the
    layers' weights; ViT has a class token, SigLIP none (every token takes part); r = 0 is unpatched."""
    from helpers.hf_stand_ins import PATCHES, hidden_states, timm_stand_in, tiny

    model, x = tiny(family), images(1).double()
    plain = hidden_states(model, x)
    PATCHES[family](model, strategy="tofu", r=0)
    assert all(torch.equal(a, b) for a, b in zip(hidden_states(model, x), plain))
    PATCHES[family](model, strategy="tofu", r=3)
    final, per_layer = tofu_reference(timm_stand_in(model, family), plain[0], merges=[3] * 4)
    hidden = hidden_states(model, x)
    for got, want in zip(hidden[1:], per_layer):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(hidden[-1], final, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(hidden[-1], plain[-1], atol=1e-4)


@pytest.mark.parametrize("name", ["hf_dinov3", "eva02"])
def test_rope_backbones_keep_each_token_at_its_destinations_rotary_position(name):
    """On DINOv3 and Eva a kept, pruned-into or merged-into token keeps its own rotary position: the
    reference on the layers run by hand with the rows of each token's original position."""
    from helpers.rope_models import rope_matches, rope_model

    m = rope_model(name)
    expected = tofu_reference(m.stand_in, m.h, merges=[3] * 4, halves=m.halves)
    m.patch_fn(m.model, strategy="tofu", r=3)
    assert rope_matches(m, expected)


def test_mlerp_rescales_merged_destinations_only():
    """A destination with sources: the unweighted mean times max norm / its own norm; every other
    token bit for bit; a zero-norm destination: the plain mean; pruning keeps destinations."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 6, 5, generator=g, dtype=torch.float64)
    x[0, 4] = 0.0
    sizes = torch.tensor([[1.0, 2.0, 1.0, 3.0, 1.0, 1.0]], dtype=torch.float64)
    src, dst = torch.tensor([[0, 2, 5]]), torch.tensor([[1, 1, 4]])
    merged, merged_sizes = tofu.mlerp(x, sizes, src, dst)  # continues as tokens 1, 3, 4
    mean = (x[0, 1] + x[0, 0] + x[0, 2]) / 3
    largest = max(x[0, j].norm() for j in (0, 1, 2))
    torch.testing.assert_close(merged[0, 0], mean * largest / x[0, 1].norm(), rtol=1e-14, atol=1e-14)
    assert torch.equal(merged[0, 1], x[0, 3])
    torch.testing.assert_close(merged[0, 2], x[0, 5] / 2, rtol=1e-14, atol=1e-14)
    assert merged_sizes.tolist() == [[4.0, 3.0, 2.0]]
    kept, kept_sizes = tofu.pruned(x, sizes, src, dst)
    assert torch.equal(kept, x[:, [1, 3, 4]]) and torch.equal(kept_sizes, merged_sizes)


@pytest.mark.parametrize("reg_tokens,r,schedule", [(0, 4, "constant"), (1, 5, "constant"), (2, 3, "decreasing"), (0, 40, "constant")])
def test_token_counts_and_eta_are_a_pure_function_of_the_schedule(reg_tokens, r, schedule):
    model = tiny_vit(reg_tokens=reg_tokens)
    patch.timm(model, strategy="tofu", r=r, schedule=schedule)
    options, p = patch.config(model), 1 + reg_tokens
    counts = patch_tokens_per_block(options, model)
    assert [c - p for c in tokens_after_each_block(model, images(2))] == counts
    assert eta(options, model) == 1 - counts[-1] / 16
    assert eta(ReductionOptions(strategy="tofu", r=3), tiny_vit()) == 12 / 16  # pruned or merged, a token goes


def test_flops_of_the_patched_forward_drop_as_r_grows():
    model = tiny_vit(reg_tokens=1)
    x = images(1)
    plain = count_flops(model.forward_features, x)
    flops = []
    for r in (0, 1, 2, 4):
        patch.timm(model, strategy="tofu", r=r)
        flops.append(count_flops(model.forward_features, x))
    assert flops[0] == plain
    assert all(later < earlier for earlier, later in zip(flops, flops[1:]))


def test_defaults_resolve_and_rows_name_the_rules():
    resolved = patch.config(patch.timm(tiny_vit(), strategy="tofu", r=3))
    assert (resolved.merge_from, resolved.prop_attn, resolved.block_range, resolved.mode) == (3, False, (0, 4), "merge")
    assert tofu.default_merge_from(12) == 7  # blocks 0-6 prune, 7-11 merge
    assert ReductionOptions.from_dict(resolved.to_dict()) == resolved
    rules = describe(resolved.resolve(BackboneShape(depth=4, num_prefix=1, has_cls=True)))
    assert "pruned before block 3" in rules["selection"] and "run frozen here" in rules["selection"]
    assert rules["averaging"].startswith("MLERP") and "no proportional attention" in rules["averaging"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(), r"needs r= \(tokens merged per block\)"),
        (dict(r=-1), "r must be None or an int >= 0"),
        (dict(r=2, merge_from=-1), "merge_from must be None or an int >= 0"),
        (dict(r=2, merge_from=1.5), "merge_from must be None or an int >= 0"),
        (dict(r=2, merge_from=True), "merge_from must be None or an int >= 0"),
        (dict(r=2, merge_from=5), "merge_from must be at most 4 .* for this 4-block model; got 5"),
        (dict(r=2, block_range=(1, 5)), "block_range must end at or before block 4"),
        (dict(r=2, ratio=0.5), "strategy 'tofu' does not take ratio .* it takes r, schedule, block_range, merge_from"),
        (dict(r=2, mode="prune"), "has no prune mode"),
        (dict(r=2, prop_attn="folded"), "folded"),
    ],
)
def test_invalid_tofu_options_name_the_field(kwargs, match):
    with pytest.raises(PullbackError, match=match):
        patch.timm(tiny_vit(), strategy="tofu", **kwargs)


def test_merge_from_needs_tofu():
    with pytest.raises(PullbackError, match="merge_from is an option of strategy 'tofu'; got strategy 'tome'"):
        ReductionOptions(strategy="tome", r=2, merge_from=1)


def test_the_patched_forward_compiles_whole_and_reads_nothing_on_the_host():
    torch._dynamo.reset()
    model = patch.timm(tiny_vit(reg_tokens=1, depth=3), strategy="tofu", r=3)  # block 0, 1 prune, block 2 merges
    x = images()
    expected = model.forward_features(x)
    with torch._dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False):
        compiled = torch.compile(model.forward_features, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, expected, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model.forward_features)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    with NoHostSync():
        model.forward_features(x)
    torch._dynamo.reset()
