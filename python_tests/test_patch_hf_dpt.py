"""pullback_ext.patch.hf_dpt on a small Hugging Face DPT with random weights."""

from __future__ import annotations

import pytest
import torch

import pullback_ext.patch as patch
from helpers.prune import norm_prune_full_llf_reference, tiny_dpt
from pullback_ext.errors import PullbackError


def pixels(n=2):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_zero_ratio_is_exact_and_unpatch_restores():
    model = tiny_dpt()
    x = pixels()
    ref = model(pixel_values=x).predicted_depth
    patch.hf_dpt(model, ratio=0.0, layers=(1, 2), strategy="tome_score")
    assert torch.equal(model(pixel_values=x).predicted_depth, ref)
    patch.hf_dpt(model, ratio=0.5, layers=(1, 2), strategy="tome_score")
    assert not torch.allclose(model(pixel_values=x).predicted_depth, ref)
    patch.unpatch(model)
    assert torch.equal(model(pixel_values=x).predicted_depth, ref)
    assert all("forward" not in vars(layer) for layer in model.dpt.encoder.layer)


def test_full_llf_matches_a_hand_written_reference_and_hidden_states_are_full():
    model = tiny_dpt()
    x = pixels()
    enc = model.dpt.encoder.layer
    h = model.dpt.embeddings(x).last_hidden_states
    h1 = enc[0](h)
    expected, frozen_at = norm_prune_full_llf_reference(h1, enc[1:3], enc[3], 6)
    patch.hf_dpt(model, ratio=6 / 16, layers=(1,), strategy="norm", llf="full")
    out = model.dpt(x, output_hidden_states=True)
    torch.testing.assert_close(out.last_hidden_state, model.dpt.layernorm(expected), rtol=1e-5, atol=1e-5)
    assert all(hs.shape == (2, 17, 32) for hs in out.hidden_states)
    for b in range(2):
        torch.testing.assert_close(out.hidden_states[3][b, frozen_at[b]], h1[b, frozen_at[b]])
    assert torch.isfinite(model(pixel_values=x).predicted_depth).all()


def test_attention_probs_match_transformers_eager_attention():
    from pullback_ext.prune.hf_encoders import attention_probs

    model = tiny_dpt()
    x = pixels()
    out = model.dpt(x, output_attentions=True)
    h = model.dpt.embeddings(x).last_hidden_states
    torch.testing.assert_close(attention_probs(model.dpt.encoder.layer[0], h), out.attentions[0].mean(1))


def test_merge_mode_and_errors():
    model = tiny_dpt()
    x = pixels()
    patch.hf_dpt(model, ratio=0.3, layers=(1,), mode="merge", strategy="cls_sim")
    assert torch.isfinite(model(pixel_values=x).predicted_depth).all()
    with pytest.raises(PullbackError, match="prop_attn must be"):
        patch.hf_dpt(model, prop_attn="yes", strategy="norm", layers=(1,))
    with pytest.raises(PullbackError, match=r"layers must lie in \[0, 2\]"):
        patch.hf_dpt(model, strategy="norm", layers=(3,))
    with pytest.raises(PullbackError, match="DPTViTEncoder"):
        patch.hf_dpt(torch.nn.Linear(2, 2), strategy="norm")


def test_biased_layer_forward_matches_the_layer_and_proportional_attention_equals_duplicates():
    from pullback_ext.prune.hf_encoders import biased_layer_forward
    from pullback_ext.prune.tokens import TokenState

    layer = tiny_dpt().dpt.encoder.layer[0]
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(biased_layer_forward(layer, x, torch.zeros(2, 1, 1, 5)), layer(x), rtol=1e-5, atol=1e-5)
    x[:, 4] = x[:, 3]  # one token twice: merging it away with log(size) bias changes nothing
    state = TokenState.start(x, num_prefix=1).merge(torch.tensor([[4], [4]]), torch.tensor([[3], [3]]))
    torch.testing.assert_close(biased_layer_forward(layer, state.x, state.attention_bias()), layer(x)[:, :4], rtol=1e-5, atol=1e-5)


def test_merge_with_proportional_attention_runs_through_the_hooked_layers():
    model = tiny_dpt()
    x = pixels()
    patch.hf_dpt(model, ratio=0.0, layers=(1,), mode="merge", strategy="tome_score", prop_attn=True)
    ref = model.dpt(x).last_hidden_state
    patch.unpatch(model)
    torch.testing.assert_close(ref, model.dpt(x).last_hidden_state)
    patch.hf_dpt(model, ratio=0.4, layers=(1,), mode="merge", strategy="tome_score", prop_attn=True)
    with_bias = model.dpt(x, output_hidden_states=True)
    patch.hf_dpt(model, ratio=0.4, layers=(1,), mode="merge", strategy="tome_score", prop_attn=False)
    without = model.dpt(x).last_hidden_state
    assert all(hs.shape == (2, 17, 32) for hs in with_bias.hidden_states)
    assert not torch.allclose(with_bias.last_hidden_state, without, atol=1e-4)


def test_masked_llf_leaves_kept_tokens_as_without_llf():
    model = tiny_dpt()
    x = pixels()
    h1 = model.dpt.encoder.layer[0](model.dpt.embeddings(x).last_hidden_states)
    outputs = {}
    for llf in (True, "full", False):
        patch.hf_dpt(model, ratio=6 / 16, layers=(1,), strategy="norm", llf=llf)
        outputs[llf] = model.dpt(x).last_hidden_state
    for b in range(2):
        pruned = torch.zeros(17, dtype=torch.bool).scatter(0, torch.argsort(h1[b, 1:].norm(dim=-1))[:6] + 1, True)
        torch.testing.assert_close(outputs[True][b, ~pruned], outputs[False][b, ~pruned], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outputs[True][b, pruned], outputs["full"][b, pruned], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(outputs[True][b, pruned], outputs[False][b, pruned], atol=1e-3)
