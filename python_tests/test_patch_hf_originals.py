"""The original methods (ToMe, PiToMe, EViT, Expedite, ASAP) on the Hugging Face families, against
the hand-written references of their own tests run on timm blocks that carry the same weights;
the split halves against each layer's forward; nothing reduced is the unpatched model; unpatching
restores it; what a family cannot run is refused."""

from __future__ import annotations


import pytest
import torch

import pullback_ext.patch as patch
from helpers.originals_reference import (asap_reference, background_reference, evit_reference, expedite_reference,
                                         pitome_reference, tome_reference, walk_reference)
from helpers.importance_tome_reference import reference as importance_tome_reference
from helpers.hf_stand_ins import PATCHES, PREFIX, SPLIT_FAMILIES, hidden_states, layers_of, timm_stand_in, tiny
from helpers.prune import images
from pullback_ext.errors import PullbackError
from pullback_ext.prune import hf_split
from pullback_ext.prune import methods
from pullback_ext.prune.methods.base import Traits, refusal
from pullback_ext.prune.hf_encoders import biased_layer_forward, masked_layer_forward
from pullback_ext.families import family as family_named
from pullback_ext.prune.merged_tokens import MergedTokens

@pytest.mark.parametrize("family", SPLIT_FAMILIES)
def test_split_halves_equal_the_layer_forward_with_and_without_a_bias(family):
    """Attention half then MLP half is the layer's own forward (LayerScale, DPT's layer, CLIP's and
    SigLIP's layers), and an additive bias reaches the logits as the layer takes it."""
    fam = family_named(family)
    layer = layers_of(tiny(family), family)[1]
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    bias = torch.randn(2, 1, 1, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    split = hf_split.split(fam)
    for b in (None, bias):
        expected = (biased_layer_forward(layer, x, b) if b is not None else type(layer).forward(layer, x)) if family == "dpt" \
            else masked_layer_forward(layer, x, b, family)
        attended = split.attend(layer, MergedTokens(x, PREFIX[family]), b)
        torch.testing.assert_close(split.feed_forward(layer, attended.x), expected, rtol=1e-6, atol=1e-6)
        assert attended.q.shape == attended.k.shape == (2, 2, 5, 16)
    state = MergedTokens(x, PREFIX[family])
    assert not torch.allclose(split.feed_forward(layer, split.attend(layer, state, bias).x),
                              split.feed_forward(layer, split.attend(layer, state, None).x), atol=1e-4)


@pytest.mark.parametrize("family", SPLIT_FAMILIES)
def test_the_attention_half_with_its_own_probabilities_given_is_the_attention_half(family):
    """``attend_with(layer, x, softmax(scale q kᵀ))`` is ``attend(layer, state, None).x`` (LayerScale,
    DPT's layer, CLIP's and SigLIP's layers)."""
    layer = layers_of(tiny(family), family)[1]
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    split = hf_split.split(family_named(family))
    attended = split.attend(layer, MergedTokens(x, PREFIX[family]), None)
    probs = ((attended.q * attended.scale) @ attended.k.transpose(-2, -1)).softmax(dim=-1)
    torch.testing.assert_close(split.attend_with(layer, x, probs), attended.x, rtol=1e-12, atol=1e-12)


def _reference(model, family, strategy, h):
    """``(final [B, N, D], [after layer i [B, N, D]])`` of the timm reference of ``strategy`` on the
    layer-0 input ``h``, with the options the patched model resolved."""
    o, stand_in = patch.config(model), timm_stand_in(model, family)
    if strategy == "tome":
        return tome_reference(stand_in, h, merges=[o.r] * 4)
    if strategy == "pitome":
        return pitome_reference(stand_in, h, merges=[o.r] * 4)
    if strategy == "evit":
        return evit_reference(stand_in, h, o.keep_rate, o.evit_layers)
    if strategy == "expedite":
        return expedite_reference(stand_in, h, o.cluster_grid, o.cluster_layer)
    return asap_reference(stand_in, h, o.layers[0], o.ratio, o.rings, o.mode, o.llf)


OPTIONS = {"tome": dict(r=3), "pitome": dict(r=3), "evit": dict(keep_rate=0.5, evit_layers=(1, 2)),
           "expedite": dict(cluster_grid=(2, 3), cluster_layer=1), "asap": dict(layers=2, ratio=0.4)}
CASES = [(f, s) for f in SPLIT_FAMILIES for s in OPTIONS if refusal(methods.get(s), Traits.of(family_named(f))) is None]


@pytest.mark.parametrize("family,strategy", CASES)
def test_each_original_matches_its_reference_on_timm_blocks_with_the_same_weights(family, strategy):
    """Every layer output (transformers' full-length hidden states, what a DPT or Depth Anything neck
    reads) is the timm reference's, merged or clustered tokens given back to their positions."""
    model = tiny(family)
    x = images(1).double()
    plain = hidden_states(model, x)
    PATCHES[family](model, strategy=strategy, **OPTIONS[strategy])
    final, per_layer = _reference(model, family, strategy, plain[0])
    hidden = hidden_states(model, x)
    assert len(hidden) == 5 and torch.equal(hidden[0], plain[0])
    for got, want in zip(hidden[1:], per_layer):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(hidden[-1], final, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(hidden[-1], plain[-1], atol=1e-4)


@pytest.mark.parametrize("family", ["vit", "siglip"])
def test_importance_tome_matches_its_reference_on_timm_blocks_with_the_same_weights(family):
    """The library's every-block merge through a Hugging Face family's split halves: every layer
    output is the float64 loop reference's on timm blocks with the same weights."""
    model, x = tiny(family), images(1).double()
    plain = hidden_states(model, x)
    head = lambda F: F.norm(dim=-1)  # noqa: E731  (positive, deterministic)
    PATCHES[family](model, strategy="importance_tome", head=head, r=2, schedule="decreasing")
    o = patch.config(model)
    final, taken, _ = importance_tome_reference(timm_stand_in(model, family), head, plain[0][0], o.r, o.schedule, o.score_layer,
                                                o.guard, o.partner, o.block_range, take=range(4))
    hidden = hidden_states(model, x)
    for i in range(4):
        torch.testing.assert_close(hidden[i + 1][0], taken[i], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(hidden[-1][0], final, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(hidden[-1], plain[-1], atol=1e-4)


def test_a_dpt_depth_model_under_tome_and_asap_prune_feeds_its_neck_full_length_features():
    model = tiny("dpt")
    x = images(2).double()
    plain = model(pixel_values=x).predicted_depth
    for strategy, options in (("tome", dict(r=4)), ("asap", dict(layers=2, ratio=0.5))):
        patch.hf_dpt(model, strategy=strategy, **options)
        assert strategy == "tome" or patch.config(model).mode == "prune"  # a dense neck: ASAP prunes
        depth = model(pixel_values=x).predicted_depth
        assert depth.shape == plain.shape and not torch.allclose(depth, plain, atol=1e-5)
    patch.unpatch(model)
    assert torch.equal(model(pixel_values=x).predicted_depth, plain)


ZERO = {"tome": dict(r=0), "pitome": dict(r=0), "evit": dict(keep_rate=1.0, evit_layers=(1, 2)),
        "asap": dict(layers=2, ratio=0.0)}


@pytest.mark.parametrize("family", list(PATCHES))
def test_nothing_reduced_is_the_unpatched_model_and_unpatch_restores_it(family):
    model = tiny(family)
    x = images(2).double()
    plain = hidden_states(model, x)
    for strategy in ZERO:
        if refusal(methods.get(strategy), Traits.of(family_named(family))) is None:
            PATCHES[family](model, strategy=strategy, **ZERO[strategy])
            assert all(torch.equal(a, b) for a, b in zip(hidden_states(model, x), plain)), strategy
    PATCHES[family](model, strategy="tome", **OPTIONS["tome"])
    assert not torch.allclose(hidden_states(model, x)[-1], plain[-1], atol=1e-4)
    patch.unpatch(model)
    assert all(torch.equal(a, b) for a, b in zip(hidden_states(model, x), plain))
    assert patch.config(model) is None and not any("forward" in vars(m) for m in model.modules())


def test_dinov3_asap_prunes_with_each_token_at_its_own_rotary_position():
    """ASAP (prune, no LLF) on DINOv3: the walk over the eager attention of layers 0, 1 run by hand,
    then layers 2, 3 on the kept tokens with the rotary rows of their own positions."""
    model = tiny("dinov3")
    model.config._attn_implementation = "eager"
    x = images(2).double()
    p, layers = PREFIX["dinov3"], model.model.layer
    pe = model.rope_embeddings(x)
    h = hidden_states(model, x)[0]
    patch.hf_dinov3(model, strategy="asap", layers=2, ratio=0.5, mode="prune", llf=False)
    expected = []
    for image in h:
        y, attentions, kept = image[None], [], list(range(h.shape[1]))
        for i, layer in enumerate(layers):
            rows = [t - p for t in kept if t >= p]
            if i == 2:
                t, sink, d = walk_reference(attentions)
                removed = background_reference(d, sink, p, 8)
                frozen = y[0].clone()
                kept = [t for t in kept if t not in removed]
                y, rows = y[:, kept], [t - p for t in kept if t >= p]
            position = (pe[0][rows], pe[1][rows])
            if i < 2:
                attentions.append(layer.attention(layer.norm1(y), position_embeddings=position)[1][0].mean(dim=0))
            y = layer(y, position_embeddings=position)
        full = frozen.clone()
        full[kept] = y[0]
        expected.append(full)
    torch.testing.assert_close(model(pixel_values=x).last_hidden_state, model.norm(torch.stack(expected)),
                               rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family,strategy", [("dinov3", "expedite"), ("siglip", "evit")])
def test_what_a_family_cannot_run_is_refused_naming_the_family_and_what_it_runs(family, strategy):
    model = tiny(family)
    runs = (r"tome, evit, asap, pitome(?:, (?!expedite)\w+)*" if family == "dinov3"
            else r"tome, asap, pitome(?:, (?!evit)\w+)*")  # and the originals added since
    reason = "needs a class token" if family == "siglip" else "no rotary position"
    with pytest.raises(PullbackError, match=rf"strategy '{strategy}' on .*{reason}.*runs the originals {runs} and the"):
        PATCHES[family](model, strategy=strategy, **OPTIONS[strategy])
    assert patch.config(model) is None
    if family == "dinov3":
        with pytest.raises(PullbackError, match="rows: .*DINOv3.*rotary rows of the current tokens"):
            hf_split.attend(model.model.layer[0], MergedTokens(torch.zeros(1, 4, 32, dtype=torch.float64), 3), None, family_named(family))
