"""MCTF as its authors run it (strategy "mctf"): against the loop-based reference of
``helpers.mctf_reference`` (timm blocks, prefix layouts, the Hugging Face families through timm
blocks with their weights), each check shown to catch a deliberately broken variant; the matching's
chains; nothing reduced is the unpatched model; token counts, η, FLOPs, options, compilation."""

from __future__ import annotations

import dataclasses
import pytest
import torch

import pullback_ext.patch as patch
from helpers.blocks import assert_zero_reduction_is_unpatched, embed, small_timm, tokens_after_each_block
from helpers.broken_merges import merges_everywhere, no_proportional_attention, unweighted_averages
from helpers.host_sync import NoHostSync
from helpers.mctf_reference import merges_here, mctf_reference
from helpers.prune import images, tiny_vit
from pullback_ext.comparison.cost import count_flops
from pullback_ext.errors import PullbackError
from pullback_ext.prune import timm_vit
from pullback_ext.prune.eta import eta, patch_tokens_per_block
from pullback_ext.prune.methods import mctf, merging
from pullback_ext.prune.reduction_options import ReductionOptions
from pullback_ext.prune.split_block import SplitBlock


def _metric_after_attention(monkeypatch):
    """Similarity of the tokens after the attention half (where ToMe matches), not of the block input."""
    rank = mctf.MCTF.rank
    monkeypatch.setattr(mctf.MCTF, "rank", lambda self, step: rank(self, step._replace(state=step.state.with_x(step.attended.x))))


def _one_direction(monkeypatch):
    """All r merges A → B (ToMe's rule on MCTF's scores), none B → A."""
    def one_way(score, order, num_prefix, count):
        best, match = score.max(dim=-1)
        return merging.matching_from_scores(order, num_prefix, score.shape[1], best, match, count)

    monkeypatch.setattr(mctf, "bidirectional_matching", one_way)


def _without(field: str):
    def broken(monkeypatch):
        scores = mctf.criteria_scores
        monkeypatch.setattr(mctf, "criteria_scores", lambda x, probs, sizes, order, a_start, size_a, options: scores(
            x, probs, sizes, order, a_start, size_a, dataclasses.replace(options.method_options, **{field: 0.0})))
    return broken


def _size_weighted_averages(monkeypatch):
    """ToMe's averaging (by size alone), not MCTF's attention × size weights."""
    monkeypatch.setattr(mctf, "fusion_weights", lambda probs, sizes: torch.ones_like(probs[:, 0, 0]) if sizes is None
                        else sizes.to(probs.dtype))


def _own_attention_after_fusion(monkeypatch):
    """The fused tokens' own attention (their ``one_step_ahead=2``), not the one-step-ahead attention."""
    monkeypatch.setattr(mctf, "attention_with", lambda split, block, state, probs: split.attend(block, state, state.size_bias()).x)


def _no_floor(monkeypatch):
    monkeypatch.setattr(mctf, "FLOOR", 0)


def _key_columns_averaged(monkeypatch):
    """The key columns of a group averaged instead of added: a fused key no longer draws the
    attention its members drew."""
    ahead = mctf.one_step_ahead

    def averaged(probs, weights, matching):
        group = merging.positions_after_merge(*matching)
        counts = torch.zeros(group.shape[0], group.shape[1] - matching.src.shape[1], dtype=probs.dtype)
        counts.scatter_add_(1, group, torch.ones_like(group, dtype=probs.dtype))
        return ahead(probs, weights, matching) / counts[:, None, None, :]

    monkeypatch.setattr(mctf, "one_step_ahead", averaged)


BROKEN = {"metric_after_attention": _metric_after_attention, "one_direction": _one_direction,
          "no_similarity": _without("tau_sim"), "no_informativeness": _without("tau_info"),
          "no_size_criterion": _without("tau_size"), "size_weighted_averages": _size_weighted_averages,
          "unweighted_averages": unweighted_averages, "own_attention_after_fusion": _own_attention_after_fusion,
          "no_floor": _no_floor, "key_columns_averaged": _key_columns_averaged, "merges_in_block_0": merges_everywhere,
          "no_proportional_attention": no_proportional_attention}


# the size term at the authors' τ_size = 40 moves no decision of this small model: shown with a sharper one
SHARPER = {"no_size_criterion": dict(tau_size=1.0)}


@pytest.mark.parametrize("broken", [None, "sharper_size", *BROKEN])
def test_mctf_matches_the_reference_and_the_check_catches_broken_variants(broken, monkeypatch):
    """18 tokens (CLS, a register), r = 3 from block 1: 18 → 15 → 12 → 10 (the 10-token floor) → 10;
    every block's full-length output is the reference's."""
    model = tiny_vit(reg_tokens=1, depth=5).double()
    x = images(2).double()
    options = SHARPER.get(broken, SHARPER["no_size_criterion"] if broken == "sharper_size" else {})
    expected, expected_blocks = mctf_reference(model, x, merges=[0, 3, 3, 3, 3], **options)
    if broken in BROKEN:
        BROKEN[broken](monkeypatch)
    patch.timm(model, strategy="mctf", r=3, **options)
    final, blocks = model.forward_intermediates(x, indices=list(range(5)), output_fmt="NLC")
    matches = torch.allclose(model.forward_features(x), expected, rtol=1e-9, atol=1e-9) and all(
        torch.allclose(got, want[:, 2:], rtol=1e-9, atol=1e-9) for got, want in zip(blocks, expected_blocks))
    assert matches == (broken not in BROKEN)


CASES = {  # (tiny_vit options, patch options, reference options, merges per block)
    "cls": (dict(), dict(r=4), dict(), [0, 4, 4, 4]),
    "no_prefix": (dict(class_token=False), dict(r=4), dict(), [0, 4, 4, 4]),
    "registers": (dict(reg_tokens=2), dict(r=5, block_range=(0, 3)), dict(), [5, 5, 5, 0]),
    "no_prop_attn": (dict(), dict(r=4, prop_attn=False), dict(prop_attn=False), [0, 4, 4, 4]),
    "temperatures": (dict(), dict(r=4, tau_sim=0.5, tau_info=2.0, tau_size=3.0),
                     dict(tau_sim=0.5, tau_info=2.0, tau_size=3.0), [0, 4, 4, 4]),
    "similarity_only": (dict(), dict(r=4, tau_info=0, tau_size=0), dict(tau_info=0.0, tau_size=0.0), [0, 4, 4, 4]),
    "decreasing": (dict(), dict(r=3, schedule="decreasing"), dict(), [0, 6, 3, 0]),
}


@pytest.mark.parametrize("case", CASES)
def test_prefix_layouts_options_and_schedules_match_the_reference(case):
    vit, options, reference, merges = CASES[case]
    model = tiny_vit(**vit).double()
    x = images(2).double()
    expected, _ = mctf_reference(model, x, merges=merges, **reference)
    patch.timm(model, strategy="mctf", **options)
    torch.testing.assert_close(model.forward_features(x), expected, rtol=1e-9, atol=1e-9)


def test_a_wider_model_with_many_merges_matches_the_reference():
    """65 tokens, r = 12 in blocks 1–3: 65 → 53 → 41 → 29, odd and even counts on both sides."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=64, patch_size=8, embed_dim=48, depth=4, num_heads=3, num_classes=0)
    with torch.no_grad():
        model.pos_embed.normal_(0.0, 0.5)
        model.cls_token.normal_(0.0, 0.5)
    model = model.double().eval().requires_grad_(False)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    expected, _ = mctf_reference(model, x, merges=[0, 12, 12, 12])
    patch.timm(model, strategy="mctf", r=12)
    torch.testing.assert_close(model.forward_features(x), expected, rtol=1e-9, atol=1e-9)


LAYER_SCALE_MODELS = [("deit3_small_patch16_224", 64), ("vit_small_patch14_reg4_dinov2", 56)]


@pytest.mark.parametrize("name,size", LAYER_SCALE_MODELS)
def test_layer_scale_and_register_models_and_r_0_is_the_unpatched_model(name, size):
    model = small_timm(name, size)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert_zero_reduction_is_unpatched(model, x, patch.timm, strategy="mctf", r=0)
    patch.timm(model, strategy="mctf", r=2)
    expected, _ = mctf_reference(model, x, merges=[0, 2, 2])
    torch.testing.assert_close(model.forward_features(x), expected, rtol=1e-9, atol=1e-9)
    patch.timm(model, strategy="mctf", r=40)  # asks for more than half the tokens: clipped
    p = model.num_prefix_tokens
    assert [c - p for c in tokens_after_each_block(model, x)] == patch_tokens_per_block(patch.config(model), model)


def test_the_matching_chains_a_token_through_a_b_token_that_moves_on():
    """Step 1 merges A token 4 into B token 1; step 2 merges B token 1 into A token 2: token 4 ends
    in token 2. Order [prefix, unmerged A (by position), merged A, B by descending step-2 score]."""
    order, size_a = merging.alternating_order(1, 7, 1, "cpu")  # [0 | 2 4 6 | 1 3 5]
    score = torch.tensor([[[0.5, 0.1, 0.2],    # A 2: best B 1 (0.5)
                           [0.9, 0.3, 0.1],    # A 4: best B 1 (0.9): merged in step 1
                           [0.2, 0.6, 0.3]]])  # A 6
    matching = mctf.bidirectional_matching(score, order, 1, 3)  # r1 = 1, r2 = 2
    # step 2 over unmerged A (2, 6): B 1 → 2 (0.5), B 3 → 6 (0.6), B 5 → 6 (0.3); the two best: 3, 1
    assert matching.order.tolist() == [[0, 2, 6, 4, 3, 1, 5]]
    assert matching.src.tolist() == [[3, 4, 5]] and matching.dst.tolist() == [[1, 2, 1]]
    after = merging.positions_after_merge(*matching)  # current index -> fused token
    assert after.tolist() == [[0, 1, 1, 2, 1, 3, 2]]  # 0 | 2 ← {4, 1} | 6 ← {3} | 5


def test_the_one_step_ahead_attention_keeps_rows_stochastic_and_weights_the_queries():
    probs = torch.rand(2, 3, 7, 7, dtype=torch.float64).softmax(dim=-1)
    weights = torch.rand(2, 7, dtype=torch.float64) + 0.1
    order, size_a = merging.alternating_order(1, 7, 2, "cpu")
    matching = mctf.bidirectional_matching(torch.rand(2, size_a, 3, dtype=torch.float64), order, 1, 3)
    ahead = mctf.one_step_ahead(probs, weights, matching)
    assert ahead.shape == (2, 3, 4, 4)
    torch.testing.assert_close(ahead.sum(dim=-1), torch.ones(2, 3, 4, dtype=torch.float64))
    group = merging.positions_after_merge(*matching)
    for b in range(2):
        members = [[t for t in range(7) if group[b, t] == g] for g in range(4)]
        for g, rows in enumerate(members):
            for c, cols in enumerate(members):
                mass = sum(weights[b, q] * probs[b, :, q, cols].sum(dim=-1) for q in rows) / sum(weights[b, q] for q in rows)
                torch.testing.assert_close(ahead[b, :, g, c], mass)


def test_the_reference_clips_r_as_the_module_does():
    for p in (0, 1, 3):
        for n in range(1, 70):
            for r in (0, 1, 2, 5, 16, 40):
                assert mctf.merge_count(r, p, n) == merges_here(r, p + n, p)


@pytest.mark.parametrize("reg_tokens,r,schedule", [(0, 3, "constant"), (1, 2, "constant"), (2, 3, "decreasing"), (0, 40, "constant")])
def test_token_counts_and_eta_are_a_pure_function_of_the_schedule(reg_tokens, r, schedule):
    model = tiny_vit(reg_tokens=reg_tokens, depth=5)
    patch.timm(model, strategy="mctf", r=r, schedule=schedule)
    options, p = patch.config(model), 1 + reg_tokens
    counts = patch_tokens_per_block(options, model)
    assert [c - p for c in tokens_after_each_block(model, images(2))] == counts
    assert counts[0] == 16 and p + counts[-1] >= 10  # block 0 never merges; 10 tokens always remain
    assert eta(options, model) == 1 - counts[-1] / 16
    assert patch_tokens_per_block(ReductionOptions(strategy="mctf", r=3), tiny_vit(depth=5)) == [16, 13, 10, 9, 9]


def test_counted_flops_fall_as_r_grows():
    x = images(1)
    flops = []
    for r in (1, 2, 4):
        model = tiny_vit(depth=4, dim=64)
        patch.timm(model, strategy="mctf", r=r)
        flops.append(count_flops(model.forward_features, x))
    assert flops[0] > flops[1] > flops[2]


def test_the_fused_attention_applies_to_the_values_alone_and_an_adapter_without_attend_with_is_refused(monkeypatch):
    """The fusing blocks cost less than the unreduced ones (no further queries, keys or logits for the
    fused tokens); a block adapter that cannot take given probabilities gives a clear refusal."""
    model = tiny_vit(reg_tokens=1, depth=4, dim=64)
    x = images(1)
    unreduced = count_flops(model.forward_features, x)
    patch.timm(model, strategy="mctf", r=3)
    assert count_flops(model.forward_features, x) < unreduced
    monkeypatch.setattr(timm_vit, "SPLIT", SplitBlock(timm_vit.attend, timm_vit.feed_forward))
    with pytest.raises(PullbackError, match="MCTF runs a block's attention half .* no attend_with"):
        model.forward_features(x)


def test_batch_rows_are_independent_and_dense_readers_get_unmerged_tokens():
    model = tiny_vit(reg_tokens=1)
    x = images(3)
    patch.timm(model, strategy="mctf", r=3)
    batched = model.forward_features(x)
    single = torch.cat([model.forward_features(x[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-5)
    grid = model.forward_intermediates(x, indices=[3], intermediates_only=True)[0]
    assert grid.shape == (3, 32, 4, 4)
    assert len(torch.unique(grid.flatten(2).transpose(1, 2)[0], dim=0)) == 8  # 16 patches fused into 8


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(), r"needs r= \(tokens merged per block\)"),
        (dict(r=-1), "r must be None or an int >= 0"),
        (dict(r=2, tau_sim=-1.0), r"tau_sim must be a finite float >= 0 \(MCTF's temperature of its similarity"),
        (dict(r=2, tau_info="20"), "tau_info must be a finite float >= 0"),
        (dict(r=2, tau_size=float("inf")), "tau_size must be a finite float >= 0"),
        (dict(r=2, tau_size=True), "tau_size must be a finite float >= 0"),
        (dict(r=2, schedule="increasing"), "schedule must be one of constant, decreasing"),
        (dict(r=2, block_range=(1, 5)), "block_range must end at or before block 4"),
        (dict(r=2, ratio=0.5), "strategy 'mctf' does not take ratio"),
        (dict(r=2, mode="prune"), "strategy 'mctf' has no prune mode"),
        (dict(r=2, keep_rate=0.5), "keep_rate is an option of strategy 'evit'"),
    ],
)
def test_invalid_mctf_options_name_the_field(kwargs, match):
    with pytest.raises(PullbackError, match=match):
        patch.timm(tiny_vit(), strategy="mctf", **kwargs)


def test_options_resolve_to_the_authors_defaults_and_round_trip():
    options = ReductionOptions(strategy="mctf", r=3, tau_info=10)
    assert (options.tau_sim, options.tau_info, options.tau_size) == (1.0, 10.0, 40.0)
    assert ReductionOptions.from_dict(options.to_dict()) == options
    resolved = patch.config(patch.timm(tiny_vit(), strategy="mctf", r=3))
    assert (resolved.block_range, resolved.prop_attn, resolved.mode) == ((1, 4), True, "merge")
    with pytest.raises(PullbackError, match=r"tau_sim is an option of strategy 'mctf'"):
        ReductionOptions(strategy="tome", r=2, tau_sim=2.0)
    with pytest.raises(PullbackError, match=r"block_range: MCTF's default .* 1-block model; give block_range=\(0, 1\)"):
        patch.timm(tiny_vit(depth=1), strategy="mctf", r=2)
    assert patch.config(patch.timm(tiny_vit(depth=1), strategy="mctf", r=2, block_range=(0, 1))).block_range == (0, 1)
    rules = mctf.METHODS[0].describe(options.resolve(timm_vit.backbone_shape(tiny_vit())))
    assert "τ 1, 10, 40" in rules["selection"] and "run frozen here" in rules["selection"]
    assert rules["averaging"].startswith("attention × size weighted, one-step-ahead attention")


def test_the_patched_forward_compiles_whole_and_reads_no_tensor_value_on_the_host():
    model = patch.timm(tiny_vit(reg_tokens=1, depth=3), strategy="mctf", r=3)
    x = images()
    expected = model.forward_features(x)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False):
            compiled = torch.compile(model.forward_features, fullgraph=True, backend="aot_eager")(x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, expected, rtol=1e-6, atol=1e-6)
    with NoHostSync():
        model.forward_features(x)


# --- the Hugging Face families, against the reference on timm blocks with their weights ---------

def _hf():
    import helpers.hf_stand_ins as hf

    return hf


@pytest.mark.parametrize("family", ["dpt", "dinov2", "vit", "clip", "siglip"])
def test_each_hugging_face_family_matches_the_reference_on_timm_blocks_with_the_same_weights(family):
    """Every layer output (the full-length hidden states a DPT neck reads) is the reference's; DINOv2
    with 2 registers and LayerScale, SigLIP without a class token."""
    hf = _hf()
    model = hf.tiny(family)
    x = images(1).double()
    plain = hf.hidden_states(model, x)
    hf.PATCHES[family](model, strategy="mctf", r=2)
    final, per_layer = mctf_reference(hf.timm_stand_in(model, family), plain[0], merges=[0, 2, 2, 2])
    hidden = hf.hidden_states(model, x)
    assert len(hidden) == 5 and torch.equal(hidden[0], plain[0])
    for got, want in zip(hidden[1:], per_layer):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(hidden[-1], final, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(hidden[-1], plain[-1], atol=1e-4)


@pytest.mark.parametrize("family", ["dpt", "dinov2", "vit", "clip", "siglip", "dinov3"])
def test_on_every_hugging_face_family_r_0_is_the_unpatched_model_and_r_2_fuses(family):
    """DINOv3 (RoPE) included: a fused token keeps its destination's rotary position."""
    hf = _hf()
    model = hf.tiny(family)
    x = images(2).double()
    plain = hf.hidden_states(model, x)
    hf.PATCHES[family](model, strategy="mctf", r=0)
    assert all(torch.equal(a, b) for a, b in zip(hf.hidden_states(model, x), plain))
    hf.PATCHES[family](model, strategy="mctf", r=2)
    fused = hf.hidden_states(model, x)
    assert torch.equal(fused[1], plain[1]) and not torch.allclose(fused[-1], plain[-1], atol=1e-4)
    patch.unpatch(model)
    assert all(torch.equal(a, b) for a, b in zip(hf.hidden_states(model, x), plain))
