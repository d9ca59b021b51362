"""PiToMe as its authors define it (strategy "pitome"): against a loop-based reference written here,
each check shown to catch a deliberately broken variant; LayerScale and register models; token
counts, η, FLOPs, options."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import pullback_ext.patch as patch
from helpers.blocks import assert_zero_reduction_is_unpatched, matches_reference, small_timm, tokens_after_each_block
from helpers.prune import images, tiny_vit
from helpers.broken_merges import merges_everywhere, unweighted_averages
from helpers.originals_reference import pitome_reference
from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods import merging, pitome
from pullback_ext.comparison.cost import count_flops
from pullback_ext.prune.eta import eta, patch_tokens_per_block
from pullback_ext.prune.reduction_options import ReductionOptions


def _features_as_keys(monkeypatch):
    rank = pitome.PiToMe.rank
    monkeypatch.setattr(pitome.PiToMe, "rank", lambda self, step: rank(self, step._replace(attended=step.attended._replace(k=step.state.x[:, None]))))


def _energy_of_the_features(monkeypatch):
    """Energy from the tokens' features (matching still on the keys)."""
    rank, energy = pitome.PiToMe.rank, pitome.energy

    def rank_scoring_features(self, step):
        unit = torch.nn.functional.normalize(step.state.x[:, step.state.num_prefix:], dim=-1)
        monkeypatch.setattr(pitome, "energy", lambda metric, margin, alpha: energy(unit, margin, alpha))
        return rank(self, step)

    monkeypatch.setattr(pitome.PiToMe, "rank", rank_scoring_features)


def _no_margin(monkeypatch):
    monkeypatch.setattr(pitome, "block_margins", lambda margin, depth: [-1.0] * depth)  # f(x) = x everywhere


def _margin_constant_over_depth(monkeypatch):
    monkeypatch.setattr(pitome, "block_margins", lambda margin, depth: [margin] * depth)


def _lowest_energy_merged(monkeypatch):
    energy = pitome.energy
    monkeypatch.setattr(pitome, "energy", lambda *args: -energy(*args))


def _prefix_tokens_merged(monkeypatch):
    rank = pitome.PiToMe.rank
    monkeypatch.setattr(pitome.PiToMe, "rank", lambda self, step: rank(self, step._replace(state=dataclasses.replace(step.state, num_prefix=0))))


def _sets_as_halves(monkeypatch):
    """A: the first half of the candidates by energy, B: the second (instead of alternating by rank)."""

    def halves(ranked, num_prefix, candidates):
        prefix = torch.arange(num_prefix).expand(ranked.shape[0], num_prefix)
        order = torch.cat([prefix, ranked[:, candidates:], ranked[:, :candidates]], dim=1)
        return order, num_prefix + ranked.shape[1] - candidates, (candidates + 1) // 2

    monkeypatch.setattr(pitome, "merge_order", halves)


def _protected_in_every_block(monkeypatch):
    monkeypatch.setattr(pitome, "bipartite_blocks", lambda depth: 0)


def _never_protected(monkeypatch):
    monkeypatch.setattr(pitome, "bipartite_blocks", lambda depth: depth)


def _energy_x_above_the_margin(monkeypatch):
    """The paper's ``f_m(x) = x`` above the margin instead of the code's ``x − m``."""

    def paper_energy(metric, margin, alpha):
        cos = metric @ metric.transpose(1, 2)
        return torch.where(cos >= margin, cos, alpha * torch.expm1(cos - margin)).mean(dim=-1)

    monkeypatch.setattr(pitome, "energy", paper_energy)


def _proportional_attention(monkeypatch):
    monkeypatch.setattr(pitome.PiToMe, "prop_attn_default", True)


BROKEN = {
    "features_as_keys": _features_as_keys, "energy_of_the_features": _energy_of_the_features, "no_margin": _no_margin,
    "margin_constant_over_depth": _margin_constant_over_depth, "lowest_energy_merged": _lowest_energy_merged,
    "prefix_tokens_merged": _prefix_tokens_merged, "sets_as_halves": _sets_as_halves,
    "protected_in_every_block": _protected_in_every_block, "never_protected": _never_protected,
    "energy_x_above_the_margin": _energy_x_above_the_margin, "proportional_attention": _proportional_attention,
    "merges_outside_the_range": merges_everywhere, "no_size_weights": unweighted_averages,
}


@pytest.mark.parametrize("broken", [None, *BROKEN])
def test_pitome_matches_the_reference_and_the_check_catches_broken_variants(broken, monkeypatch):
    model = tiny_vit(reg_tokens=1, depth=5).double()
    x = images(2).double()
    expected, expected_blocks = pitome_reference(model, x, merges=[0, 3, 3, 3, 0], margin=0.5)
    if broken:
        BROKEN[broken](monkeypatch)
        monkeypatch.setattr(merging, "FUSED", False)  # the variants break the unfused path's pieces
    patch.timm(model, strategy="pitome", r=3, block_range=(1, 4), margin=0.5)
    assert matches_reference(model, x, expected, expected_blocks) == (broken is None)


def test_the_authors_defaults_and_other_margin_alpha_and_proportional_attention_match_the_reference():
    model = tiny_vit(depth=4).double()
    x = images(2).double()
    patch.timm(model, strategy="pitome", r=4)
    assert patch.config(model).margin == 0.75 and patch.config(model).prop_attn is False
    expected, blocks = pitome_reference(model, x, merges=[4, 4, 4, 4])
    assert matches_reference(model, x, expected, blocks)
    patch.timm(model, strategy="pitome", r=4, energy_alpha=0.25, margin=0.3, prop_attn=True)
    expected, blocks = pitome_reference(model, x, merges=[4, 4, 4, 4], margin=0.3, alpha=0.25, prop_attn=True)
    assert matches_reference(model, x, expected, blocks)


LAYER_SCALE_MODELS = [("vit_small_patch14_dinov2", 56), ("deit3_small_patch16_224", 64), ("vit_small_patch14_reg4_dinov2", 56)]


@pytest.mark.parametrize("name,size", LAYER_SCALE_MODELS)
def test_layer_scale_and_register_models(name, size):
    """r = 0 is the unpatched model bit for bit; r > 0 is the reference that applies ls1 / ls2."""
    model = small_timm(name, size)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    plain = assert_zero_reduction_is_unpatched(model, x, patch.timm, strategy="pitome", r=0)
    patch.timm(model, strategy="pitome", r=4, schedule="decreasing")
    expected, blocks = pitome_reference(model, x, merges=merging.merges_per_block(4, "decreasing", 3))
    assert matches_reference(model, x, expected, blocks)
    patch.unpatch(model)
    assert torch.equal(model.forward_features(x), plain)


@pytest.mark.parametrize("reg_tokens,r,schedule", [(0, 4, "constant"), (1, 5, "constant"), (2, 3, "decreasing"), (0, 40, "constant")])
def test_token_counts_and_eta_are_a_pure_function_of_the_schedule(reg_tokens, r, schedule):
    model = tiny_vit(reg_tokens=reg_tokens)
    patch.timm(model, strategy="pitome", r=r, schedule=schedule)
    options, p = patch.config(model), 1 + reg_tokens
    counts = patch_tokens_per_block(options, model)
    assert [c - p for c in tokens_after_each_block(model, images(2))] == counts
    assert eta(options, model) == 1 - counts[-1] / 16
    assert eta(ReductionOptions(strategy="pitome", r=40), tiny_vit()) == 15 / 16  # 16 -> 8 -> 4 -> 2 -> 1: half at most
    assert eta(ReductionOptions(strategy="pitome", r=3), tiny_vit()) == 12 / 16


def test_flops_of_the_patched_forward_drop_as_r_grows():
    model = tiny_vit(reg_tokens=1)
    x = images(1)
    plain = count_flops(model.forward_features, x)
    flops = []
    for r in (0, 1, 2, 4, 6):
        patch.timm(model, strategy="pitome", r=r)
        flops.append(count_flops(model.forward_features, x))
    assert flops[0] == plain
    assert all(later < earlier for earlier, later in zip(flops, flops[1:]))


def test_batch_rows_are_independent_and_dense_readers_get_unmerged_tokens():
    model = tiny_vit(reg_tokens=1)
    x = images(3)
    patch.timm(model, strategy="pitome", r=4)
    batched = model.forward_features(x)
    single = torch.cat([model.forward_features(x[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-5)
    grid = model.forward_intermediates(x, indices=[3], intermediates_only=True)[0]
    assert grid.shape == (3, 32, 4, 4)
    assert len(torch.unique(grid.flatten(2).transpose(1, 2)[0], dim=0)) == 2  # 16 -> 12 -> 8 -> 4 -> 2 (half at most)


def test_block_margins_fall_linearly_from_the_first_block():
    assert pitome.block_margins(0.75, 3) == pytest.approx([0.75, 0.5, 0.25], abs=1e-15)
    assert pitome.block_margins(0.75, 12)[0] == 0.75 and pitome.block_margins(0.75, 12)[-1] == pytest.approx(0.0625, abs=1e-15)
    assert [pitome.bipartite_blocks(d) for d in (1, 4, 5, 12)] == [1, 2, 3, 6]
    assert pitome.merge_count(8, 17) == 8 and pitome.merge_count(9, 17) == 8 and pitome.merge_count(3, 1) == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(), r"needs r= \(tokens merged per block\)"),
        (dict(r=-1), "r must be None or an int >= 0"),
        (dict(r=2, schedule="increasing"), "schedule must be one of constant, decreasing"),
        (dict(r=2, block_range=(1, 5)), "block_range must end at or before block 4"),
        (dict(r=2, margin=1.5), r"margin must be a float in \[0, 1\]"),
        (dict(r=2, margin="0.9"), r"margin must be a float in \[0, 1\]"),
        (dict(r=2, energy_alpha=-1.0), "energy_alpha must be a finite float >= 0"),
        (dict(r=2, energy_alpha=float("inf")), "energy_alpha must be a finite float >= 0"),
        (dict(r=2, ratio=0.5), "strategy 'pitome' does not take ratio .* it takes r, schedule, block_range, margin, "
                               "energy_alpha and prop_attn"),
        (dict(r=2, mode="prune"), "has no prune mode"),
        (dict(r=2, keep_rate=0.5), "keep_rate is an option of strategy 'evit'"),
    ],
)
def test_invalid_pitome_options_name_the_field(kwargs, match):
    with pytest.raises(PullbackError, match=match):
        patch.timm(tiny_vit(), strategy="pitome", **kwargs)


def test_pitome_fields_need_pitome_and_the_shared_ones_name_both_methods():
    with pytest.raises(PullbackError, match="margin is an option of strategy 'pitome'; got strategy 'tome'"):
        ReductionOptions(strategy="tome", r=2, margin=0.5)
    with pytest.raises(PullbackError, match="energy_alpha is an option of strategy 'pitome'; got strategy 'norm'"):
        ReductionOptions(strategy="norm", energy_alpha=0.5)
    with pytest.raises(PullbackError, match="r is an option of strategy 'tome', 'pitome', .*'importance_tome'.*; got strategy 'evit'"):
        ReductionOptions(strategy="evit", keep_rate=0.5, r=2)


def test_options_round_trip_no_renaming_note_and_the_hugging_face_backbones_take_it():
    from helpers.prune import tiny_dinov2, tiny_hf

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pitome is new: no note that its meaning changed
        options = ReductionOptions(strategy="pitome", r=3, schedule="decreasing", block_range=[1, 3], margin=0.7,
                                   energy_alpha=0.5, prop_attn=False)
    assert options.block_range == (1, 3)
    assert ReductionOptions.from_dict(options.to_dict()) == options
    resolved = patch.config(patch.timm(tiny_vit(), strategy="pitome", r=3))
    assert (resolved.block_range, resolved.prop_attn, resolved.mode, resolved.margin, resolved.energy_alpha) == (
        (0, 4), False, "merge", 0.75, 1.0)
    assert patch.config(patch.hf_dinov2(tiny_dinov2(), strategy="pitome", r=2)).r == 2
    assert patch.config(patch.hf_dinov3(tiny_hf("dinov3"), strategy="pitome", r=2)).r == 2  # RoPE: see test_rope_originals
