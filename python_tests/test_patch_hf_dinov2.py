"""pullback_ext.patch.hf_dinov2 on small Hugging Face DINOv2 models (with and without registers,
and as the backbone of Depth Anything) with random weights."""

from __future__ import annotations

import copy

import pytest
import torch

import pullback_ext.patch as patch
from helpers.diagnose import tiny_depth_anything
from helpers.prune import norm_merge_reference, norm_prune_full_llf_reference, tiny_dinov2
from pullback_ext.errors import PullbackError
from pullback_ext.prune.hf_encoders import dinov2_attention_probs, dinov2_biased_forward, find_encoder
from pullback_ext.prune.tokens import TokenState

N = 17  # 16 patches of a 32 px image at patch 8, plus CLS


def pixels(n=2):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_zero_ratio_is_exact_and_unpatch_restores(attn):
    model = tiny_dinov2(attn)
    x = pixels()
    ref = model(pixel_values=x).pooler_output
    patch.hf_dinov2(model, ratio=0.0, layers=(1, 2), strategy="tome_score")
    assert patch.config(model).mode == "merge"  # auto: a CLS model merges
    assert torch.equal(model(pixel_values=x).pooler_output, ref)
    patch.hf_dinov2(model, ratio=0.5, layers=(1, 2), strategy="tome_score")
    merged = model(pixel_values=x, output_hidden_states=True)
    assert not torch.allclose(merged.pooler_output, ref)
    assert len(merged.hidden_states) == 5 and all(h.shape == (2, N, 32) for h in merged.hidden_states)
    patch.unpatch(model)
    assert torch.equal(model(pixel_values=x).pooler_output, ref)
    assert "forward" not in vars(model.encoder) and all("forward" not in vars(layer) for layer in model.encoder.layer)


def test_prune_with_full_llf_matches_a_hand_written_reference():
    model = tiny_dinov2()
    x = pixels()
    enc = model.encoder.layer
    h1 = enc[0](model.embeddings(x))
    expected, frozen_at = norm_prune_full_llf_reference(h1, enc[1:3], enc[3], 6)
    patch.hf_dinov2(model, ratio=6 / 16, layers=(1,), mode="prune", strategy="norm", llf="full")
    out = model(pixel_values=x, output_hidden_states=True)
    torch.testing.assert_close(out.last_hidden_state, model.layernorm(expected), rtol=1e-5, atol=1e-5)
    assert all(hs.shape == (2, N, 32) for hs in out.hidden_states)
    for b in range(2):
        torch.testing.assert_close(out.hidden_states[3][b, frozen_at[b]], h1[b, frozen_at[b]])


def test_attention_probs_match_transformers_eager_attention():
    model = tiny_dinov2("eager")
    x = pixels()
    out = model(pixel_values=x, output_attentions=True)
    h = model.embeddings(x)
    torch.testing.assert_close(dinov2_attention_probs(model.encoder.layer[0], h), out.attentions[0].mean(1))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_biased_forward_matches_the_layer_and_proportional_attention_equals_duplicates(attn):
    layer = tiny_dinov2(attn).encoder.layer[0]
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(dinov2_biased_forward(layer, x, torch.zeros(2, 1, 1, 5)), layer(x), rtol=1e-5, atol=1e-5)
    x[:, 4] = x[:, 3]  # one token twice: merging it away with log(size) bias changes nothing
    state = TokenState.start(x, num_prefix=1).merge(torch.tensor([[4], [4]]), torch.tensor([[3], [3]]))
    torch.testing.assert_close(dinov2_biased_forward(layer, state.x, state.attention_bias()), layer(x)[:, :4],
                               rtol=1e-5, atol=1e-5)


def test_masked_llf_leaves_kept_tokens_as_without_llf():
    model = tiny_dinov2("sdpa")
    x = pixels()
    h1 = model.encoder.layer[0](model.embeddings(x))
    outputs = {}
    for llf in (True, "full", False):
        patch.hf_dinov2(model, ratio=6 / 16, layers=(1,), mode="prune", strategy="norm", llf=llf)
        outputs[llf] = model(pixel_values=x).last_hidden_state
    for b in range(2):
        pruned = torch.zeros(N, dtype=torch.bool).scatter(0, torch.argsort(h1[b, 1:].norm(dim=-1))[:6] + 1, True)
        torch.testing.assert_close(outputs[True][b, ~pruned], outputs[False][b, ~pruned], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outputs[True][b, pruned], outputs["full"][b, pruned], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(outputs[True][b, pruned], outputs[False][b, pruned], atol=1e-3)


def test_registers_are_never_pruned():
    model = tiny_dinov2(registers=2)
    model.embeddings.register_tokens.zero_()  # the lowest norms: the first to go if they were patch tokens
    assert find_encoder(model).num_prefix == 3
    x = pixels()
    patch.hf_dinov2(model, ratio=0.5, layers=(1,), mode="prune", strategy="norm", llf=False)
    hs = model(pixel_values=x, output_hidden_states=True).hidden_states
    assert len(hs) == 5 and all(h.shape == (2, N + 2, 32) for h in hs)
    frozen = (hs[4] == hs[1]).all(dim=-1)  # pruned at the input of block 1, never updated again
    assert frozen[:, :3].sum() == 0 and (frozen.sum(dim=1) == 8).all()


def test_depth_anything_prunes_through_its_dinov2_backbone():
    model = tiny_depth_anything(dtype=torch.float32).requires_grad_(False)
    x = pixels()
    ref = model(pixel_values=x).predicted_depth
    feature_shapes = [f.shape for f in model.backbone(x).feature_maps]
    patch.hf_dinov2(model, ratio=0.0, layers=(1, 2), strategy="tome_score")
    assert patch.config(model).mode == "prune" and patch.config(model).llf == "masked"  # auto: a dense neck
    assert torch.equal(model(pixel_values=x).predicted_depth, ref)
    patch.hf_dinov2(model, ratio=0.4, layers=(1, 2), strategy="tome_score")
    assert [f.shape for f in model.backbone(x).feature_maps] == feature_shapes
    pruned = model(pixel_values=x).predicted_depth
    assert torch.isfinite(pruned).all() and not torch.allclose(pruned, ref)
    patch.hf_dpt(model, ratio=0.4, layers=(1, 2), strategy="tome_score")  # the DPT entry point takes it too
    torch.testing.assert_close(model(pixel_values=x).predicted_depth, pruned)
    patch.unpatch(model)
    assert torch.equal(model(pixel_values=x).predicted_depth, ref)


def test_errors_name_what_is_wrong():
    model = tiny_dinov2()
    patch.hf_dinov2(model, ratio=0.3, layers=(1,), strategy="norm")
    h = model.embeddings(pixels())
    with pytest.raises(PullbackError, match=r"attention_mask: .* shape \[2, 1, 17, 17\]"):
        model.encoder(h, attention_mask=torch.zeros(2, 1, N, N))
    with pytest.raises(PullbackError, match=r"layers must lie in \[0, 2\]"):
        patch.hf_dinov2(model, mode="prune", strategy="norm", layers=(3,))
    with pytest.raises(PullbackError, match="DINOv2"):
        patch.hf_dinov2(torch.nn.Linear(2, 2), strategy="norm")
    layer = copy.deepcopy(model.encoder.layer[0])
    layer.attention.config = copy.copy(layer.attention.config)
    layer.attention.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(PullbackError, match="'flash_attention_2' takes no additive attention mask"):
        dinov2_biased_forward(layer, h[:, :5], torch.zeros(2, 1, 1, 5))


def depth_anything_and_its_backbone_as_dinov2():
    """A tiny float64 Depth Anything with LayerScale factors that matter, and a ``Dinov2Model`` with
    the same embedding, layers and final norm."""
    from transformers import Dinov2Model

    model = tiny_depth_anything().requires_grad_(False)
    with torch.no_grad():
        for layer in model.backbone.encoder.layer:
            layer.layer_scale1.lambda1.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(5))
    dinov2 = Dinov2Model(model.backbone.config).double().eval().requires_grad_(False)
    missing, unexpected = dinov2.load_state_dict(model.backbone.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("pooler") for name in missing)
    return model, dinov2


def test_depth_anything_merge_matches_a_hand_written_reference():
    """Merge mode through the DINOv2 backbone: every hidden state the neck reads is the reference's
    merged tokens given back to their positions, and the depth head runs on them."""
    model = tiny_depth_anything().requires_grad_(False)
    x = pixels().double()
    enc = model.backbone.encoder.layer
    h1 = enc[0](model.backbone.embeddings(x))
    expected = norm_merge_reference(h1, enc[1:], 5)
    plain = model(pixel_values=x).predicted_depth
    patch.hf_dinov2(model, ratio=5 / 16, layers=(1,), mode="merge", strategy="norm", matching="cosine", prop_attn=False)
    hidden = model.backbone(x, output_hidden_states=True).hidden_states
    torch.testing.assert_close(hidden[-1], expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(hidden[1], h1, rtol=0, atol=0)
    depth = model(pixel_values=x).predicted_depth
    assert depth.shape == plain.shape and torch.isfinite(depth).all() and not torch.allclose(depth, plain, atol=1e-6)


def test_depth_anything_proportional_attention_equals_duplicates():
    """A token merged with its exact duplicate, with log(size) on the logits, is what the backbone's
    layer computes on both copies; under the patch the bias reaches the backbone's layers."""
    model = tiny_depth_anything().requires_grad_(False)
    layer = model.backbone.encoder.layer[1]
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x[:, 4] = x[:, 3]
    state = TokenState.start(x, num_prefix=1).merge(torch.tensor([[4], [4]]), torch.tensor([[3], [3]]))
    torch.testing.assert_close(dinov2_biased_forward(layer, state.x, state.attention_bias()), layer(x)[:, :4],
                               rtol=1e-9, atol=1e-9)
    assert not torch.allclose(dinov2_biased_forward(layer, state.x, None), layer(x)[:, :4], atol=1e-4)
    images_ = pixels().double()
    outputs = []
    for prop_attn in (True, False):
        patch.hf_dinov2(model, ratio=0.5, layers=(1,), mode="merge", strategy="norm", prop_attn=prop_attn)
        outputs.append(model.backbone(images_).feature_maps[-1])
    assert not torch.allclose(*outputs, atol=1e-6)


ORIGINALS = {"tome": dict(r=3), "pitome": dict(r=3), "evit": dict(keep_rate=0.5, evit_layers=(1, 2)),
             "expedite": dict(cluster_grid=(2, 3), cluster_layer=1), "asap": dict(layers=2, ratio=0.4, mode="prune")}


@pytest.mark.parametrize("strategy", list(ORIGINALS))
def test_depth_anything_runs_each_original_as_the_dinov2_model_with_the_same_weights(strategy):
    """The backbone's hidden states (what the neck reads) under each original are those of HF
    DINOv2's loop on the same weights (which test_patch_hf_originals checks against the references)."""
    model, dinov2 = depth_anything_and_its_backbone_as_dinov2()
    x = pixels().double()
    plain = model(pixel_values=x).predicted_depth
    patch.hf_dinov2(model, strategy=strategy, **ORIGINALS[strategy])
    patch.hf_dinov2(dinov2, strategy=strategy, **ORIGINALS[strategy])
    got = model.backbone(x, output_hidden_states=True).hidden_states
    want = dinov2(pixel_values=x, output_hidden_states=True).hidden_states
    assert len(got) == len(want) == 5 and all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.allclose(got[-1], model.backbone.embeddings(x), atol=1e-3)
    depth = model(pixel_values=x).predicted_depth
    assert depth.shape == plain.shape and torch.isfinite(depth).all() and not torch.allclose(depth, plain, atol=1e-6)
