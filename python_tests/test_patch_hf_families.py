"""pullback_ext.patch.hf_vit / hf_clip / hf_siglip / hf_dinov3 on small Hugging Face models with
random weights: exactness at ratio 0, hand-written references of prune (full LLF) and merge (RoPE
positions included), attention, unpatching, the transformers versions the mirrors were checked against."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import operator

import pytest
import torch

import pullback_ext.patch as patch
from helpers.prune import (attention_prune_reference, images, norm_merge_reference, norm_prune_full_llf_reference,
                           tiny_dinov2, tiny_hf)
from pullback_ext.errors import PullbackError
from pullback_ext.prune.hf_encoders import attention_probs, masked_layer_forward
from pullback_ext.families.versions import CHECKED_TRANSFORMERS, MIRRORS
from pullback_ext.prune.tokens import TokenState

PATCHES = {"vit": patch.hf_vit, "vit_cls": patch.hf_vit, "clip": patch.hf_clip, "clip_projection": patch.hf_clip,
           "siglip": patch.hf_siglip, "dinov3": patch.hf_dinov3, "dinov3_backbone": patch.hf_dinov3}
FAMILY = {"vit_cls": "vit", "clip_projection": "clip", "dinov3_backbone": "dinov3"}
PREFIX = {"vit": 1, "clip": 1, "siglip": 0, "dinov3": 3}  # dinov3: CLS + 2 registers


def outputs(model, kind: str, x: torch.Tensor):
    """``(main output, hidden states)``: what each model class returns as its result."""
    out = model(pixel_values=x, output_hidden_states=True)
    main = {"vit_cls": "logits", "clip_projection": "image_embeds"}.get(kind, "pooler_output")
    if kind == "dinov3_backbone":
        return torch.cat([f.flatten(1) for f in out.feature_maps], dim=1), out.hidden_states
    return out[main], out.hidden_states


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", list(PATCHES))
def test_zero_ratio_is_exact_merging_changes_the_output_and_unpatch_restores(kind, attn):
    model = tiny_hf(kind, attn)
    x = images(2)
    ref, ref_hidden = outputs(model, kind, x)
    PATCHES[kind](model, ratio=0.0, layers=(1, 2), strategy="tome_score")
    main, hidden = outputs(model, kind, x)
    assert torch.equal(main, ref) and len(hidden) == 5 and all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))
    PATCHES[kind](model, ratio=0.5, layers=(1, 2), mode="merge", strategy="tome_score")
    main, hidden = outputs(model, kind, x)
    assert not torch.allclose(main, ref, atol=1e-4)
    assert [h.shape for h in hidden] == [h.shape for h in ref_hidden]  # full-length
    patch.unpatch(model)
    main, hidden = outputs(model, kind, x)
    assert torch.equal(main, ref) and all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))
    assert patch.config(model) is None and not any("forward" in vars(m) for m in model.modules())


def parts(model, family: str, x: torch.Tensor):
    """``(input of layer 0 [B, N, D], layers, call(layer, y, kept), final(h), position table)`` of an
    unpatched model, ``final`` turning the last layer's output into ``last_hidden_state``."""
    pe = model.rope_embeddings(x) if family == "dinov3" else None

    def call(layer, y, kept):
        if pe is None:
            return layer(y, None)
        patches = [t - PREFIX[family] for t in kept if t >= PREFIX[family]]
        return layer(y, position_embeddings=(pe[0][patches], pe[1][patches]))

    if family == "vit":
        return model.embeddings(x), model.layers, call, model.layernorm, pe
    if family == "clip":
        return model.pre_layrnorm(model.embeddings(x)), model.encoder.layers, call, lambda h: h, pe
    if family == "siglip":
        return model.embeddings(x), model.encoder.layers, call, model.post_layernorm, pe
    return model.embeddings(x), model.model.layer, call, model.norm, pe


@pytest.mark.parametrize("family", ["vit", "clip", "siglip", "dinov3"])
def test_prune_with_full_llf_matches_a_hand_written_reference(family):
    """Pruned tokens are frozen and come back, RoPE models at their own positions."""
    model = tiny_hf(family)
    x = images(2)
    h0, layers, call, final, _ = parts(model, family, x)
    h1 = call(layers[0], h0, list(range(h0.shape[1])))
    expected, frozen_at = norm_prune_full_llf_reference(h1, layers[1:3], layers[3], 6, PREFIX[family], call)
    PATCHES[family](model, ratio=6 / 16, layers=(1,), mode="prune", strategy="norm", llf="full")
    out = model(pixel_values=x, output_hidden_states=True)
    torch.testing.assert_close(out.last_hidden_state, final(expected), rtol=1e-5, atol=1e-5)
    for b in range(2):
        torch.testing.assert_close(out.hidden_states[3][b, frozen_at[b]], h1[b, frozen_at[b]])


@pytest.mark.parametrize("family", ["vit", "clip", "siglip", "dinov3"])
def test_merge_matches_a_hand_written_reference(family):
    """Merged tokens are size-weighted averages at their destination (its rotary position for RoPE
    models), and every original position reads the output of the token it went into."""
    model = tiny_hf(family)
    x = images(2)
    h0, layers, call, final, _ = parts(model, family, x)
    h1 = call(layers[0], h0, list(range(h0.shape[1])))
    expected = norm_merge_reference(h1, layers[1:], 5, PREFIX[family], call)
    PATCHES[family](model, ratio=5 / 16, layers=(1,), mode="merge", strategy="norm", matching="cosine", prop_attn=False)
    torch.testing.assert_close(model(pixel_values=x).last_hidden_state, final(expected), rtol=1e-5, atol=1e-5)


def test_dinov3_rotary_positions_follow_the_tokens_and_not_their_new_order():
    """Giving the kept tokens the first rows of the table instead of their own changes the result."""
    model = tiny_hf("dinov3")
    x = images(2)
    h0, layers, call, final, pe = parts(model, "dinov3", x)
    h1 = call(layers[0], h0, list(range(h0.shape[1])))

    def shifted(layer, y, kept):
        k = y.shape[1] - PREFIX["dinov3"]
        return layer(y, position_embeddings=(pe[0][:k], pe[1][:k]))

    wrong, _ = norm_prune_full_llf_reference(h1, layers[1:3], layers[3], 6, 3, shifted)
    patch.hf_dinov3(model, ratio=6 / 16, layers=(1,), mode="prune", strategy="norm", llf="full")
    assert not torch.allclose(model(pixel_values=x).last_hidden_state, final(wrong), atol=1e-3)


def test_dinov3_attention_strategies_read_each_stage_with_the_current_positions():
    """evit_score over two consecutive stages: the attention of block 1 runs on the tokens kept at
    stage 1 with their own rotary rows (transformers' eager attention as the reference)."""
    model = tiny_hf("dinov3", "eager")
    x = images(2)
    h0, layers, call, final, pe = parts(model, "dinov3", x)
    p = PREFIX["dinov3"]

    def attention(layer, y, kept):
        patches = [t - p for t in kept if t >= p]
        return layer.attention(layer.norm1(y), position_embeddings=(pe[0][patches], pe[1][patches]))[1].mean(dim=1)

    expected = attention_prune_reference(h0, layers, call, attention, (1, 2), 4, p)
    patch.hf_dinov3(model, ratio=(4 / 16, 4 / 16), layers=(1, 2), mode="prune", strategy="evit_score", llf=False)
    torch.testing.assert_close(model(pixel_values=x).last_hidden_state, final(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["vit", "clip", "siglip", "dinov3"])
def test_attention_probs_match_transformers_eager_attention(family):
    model = tiny_hf(family, "eager")
    x = images(2)
    h0, layers, _, _, pe = parts(model, family, x)
    out = model(pixel_values=x, output_attentions=True)
    torch.testing.assert_close(attention_probs(layers[0], h0, family=family, position_embeddings=pe),
                               out.attentions[0].mean(1))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["vit", "clip", "siglip", "dinov3"])
def test_proportional_attention_through_the_attention_mask_equals_duplicates(family, attn):
    model = tiny_hf(family, attn)
    _, layers, _, _, pe = parts(model, family, images(1))
    extra = {} if pe is None else {"position_embeddings": (pe[0][:2], pe[1][:2])}  # 3 prefix + 2 patches
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(masked_layer_forward(layers[0], x, torch.zeros(2, 1, 1, 5), family, **extra),
                               masked_layer_forward(layers[0], x, None, family, **extra), rtol=1e-5, atol=1e-5)
    if pe is not None:
        return  # a duplicate at another position is another token under RoPE
    x[:, 4] = x[:, 3]  # one token twice: merging it away with log(size) bias changes nothing
    state = TokenState.start(x, num_prefix=PREFIX[family]).merge(torch.tensor([[4], [4]]), torch.tensor([[3], [3]]))
    torch.testing.assert_close(masked_layer_forward(layers[0], state.x, state.attention_bias(), family),
                               layers[0](x, None)[:, :4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["vit", "clip", "siglip", "dinov3"])
def test_masked_llf_leaves_kept_tokens_as_without_llf(family):
    model = tiny_hf(family, "sdpa")
    x = images(2)
    h0, layers, call, _, _ = parts(model, family, x)
    h1 = call(layers[0], h0, list(range(h0.shape[1])))
    results = {}
    for llf in (True, "full", False):
        PATCHES[family](model, ratio=6 / 16, layers=(1,), mode="prune", strategy="norm", llf=llf)
        results[llf] = model(pixel_values=x).last_hidden_state
    p = PREFIX[family]
    for b in range(2):
        pruned = torch.zeros(h0.shape[1], dtype=torch.bool).scatter(0, torch.argsort(h1[b, p:].norm(dim=-1))[:6] + p, True)
        torch.testing.assert_close(results[True][b, ~pruned], results[False][b, ~pruned], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(results[True][b, pruned], results["full"][b, pruned], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(results[True][b, pruned], results[False][b, pruned], atol=1e-3)


@pytest.mark.parametrize("kind", ["dinov2", "vit", "clip", "siglip", "dinov3"])
def test_a_stage_at_layer_0_keeps_hidden_states_0_the_embedding(kind):
    """transformers records the first layer's input as hidden_states[0]: it stays full-length."""
    model = tiny_dinov2() if kind == "dinov2" else tiny_hf(kind)
    x = images(2)
    ref = model(pixel_values=x, output_hidden_states=True).hidden_states
    patch.auto(model, ratio=0.5, layers=(0,), mode="merge", strategy="norm")
    hidden = model(pixel_values=x, output_hidden_states=True).hidden_states
    assert torch.equal(hidden[0], ref[0]) and [h.shape for h in hidden] == [h.shape for h in ref]
    assert not torch.allclose(hidden[1], ref[1], atol=1e-4)


def test_siglip_merges_without_a_class_token_and_refuses_the_strategies_that_read_it():
    model = tiny_hf("siglip")
    x = images(2)
    ref = model(pixel_values=x).pooler_output
    patch.hf_siglip(model, ratio=0.5, layers=(1,), strategy="norm")
    assert patch.config(model).mode == "merge"
    assert torch.isfinite(model(pixel_values=x).pooler_output).all()
    for strategy in ("evit_score", "cls_sim"):
        with pytest.raises(PullbackError, match="needs a class token"):
            patch.hf_siglip(model, ratio=0.5, layers=(1,), strategy=strategy)
    patch.unpatch(model)
    assert torch.equal(model(pixel_values=x).pooler_output, ref)


def test_dinov3_backbone_prunes_by_default_and_keeps_its_registers():
    model = tiny_hf("dinov3_backbone", out_indices=[1, 3])
    model.embeddings.register_tokens.zero_()  # the lowest norms: the first to go if they were patch tokens
    x = images(2)
    shapes = [f.shape for f in model(pixel_values=x).feature_maps]
    patch.hf_dinov3(model, ratio=0.5, layers=(1,), strategy="norm", llf=False)
    assert patch.config(model).mode == "prune"
    out = model(pixel_values=x)
    assert [f.shape for f in out.feature_maps] == shapes
    hidden = model(pixel_values=x, output_hidden_states=True).hidden_states
    frozen = (hidden[4] == hidden[1]).all(dim=-1)  # pruned at the input of block 1, never updated again
    assert frozen[:, :3].sum() == 0 and (frozen.sum(dim=1) == 8).all()


def test_originals_and_flash_attention_are_refused_clearly():
    with pytest.raises(PullbackError, match=r"strategy 'expedite' on .*DINOv3.*runs the originals tome, evit, asap, pitome(?:, (?!expedite)\w+)* and the"):
        patch.hf_dinov3(tiny_hf("dinov3"), strategy="expedite", cluster_grid=(2, 2), cluster_layer=1)
    model = tiny_hf("clip")
    layer = model.encoder.layers[0]
    layer.self_attn.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(PullbackError, match="'flash_attention_2' takes no additive attention mask"):
        masked_layer_forward(layer, torch.zeros(2, 5, 32), torch.zeros(2, 1, 1, 5), "clip")
    with pytest.raises(PullbackError, match="CLIP vision model"):
        patch.hf_clip(tiny_hf("siglip"), strategy="norm")


def test_the_mirrored_upstream_code_is_unchanged():
    """Fails when transformers changes code the adapters mirror: re-read it against the code named."""
    for where, (recorded, mirrored_by) in MIRRORS.items():
        module, name = where.split(":")
        source = inspect.getsource(operator.attrgetter(name)(importlib.import_module(module)))
        digest = hashlib.sha256(source.encode()).hexdigest()
        assert digest == recorded, (
            f"{where} changed upstream (sha256 {digest}); re-check {mirrored_by} in pullback_ext/prune against the new "
            f"source, then record the new hash in families/versions.py MIRRORS and the versions in CHECKED_TRANSFORMERS")


@pytest.mark.parametrize("version", ["5.23.0", CHECKED_TRANSFORMERS[1] + ".0"])
def test_transformers_outside_the_checked_range_is_refused(version, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", version)
    for kind in ("vit", "clip", "siglip", "dinov3"):
        with pytest.raises(PullbackError, match=rf"mirrors transformers 5\.24 up to .* {version} is installed"):
            PATCHES[kind](tiny_hf(kind), strategy="norm", layers=(1,))
