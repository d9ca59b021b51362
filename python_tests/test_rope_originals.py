"""The original methods on the RoPE backbones (Hugging Face DINOv3, timm Eva): ToMe, PiToMe, EViT and
ASAP against the hand-written references of their own tests, run on the unpatched layers by hand
where each current token is rotated by the rows of its original position (a merged token: its
destination's; EViT's fused token: not rotated); a check that fails if the rows follow the tokens'
new order; nothing reduced is the unpatched model; unpatching restores it; Expedite is refused."""

from __future__ import annotations

import pytest
import torch

import pullback_ext.patch as patch
from helpers.originals_reference import asap_reference, evit_reference, pitome_reference, tome_reference
from helpers.rope_models import EVAS, rope_matches, rope_model
from pullback_ext.errors import PullbackError
from pullback_ext.prune import rope

def _rows_in_new_order(monkeypatch):
    """Broken: each current token takes the row of its index in the reduced sequence (positions not tracked)."""
    select = rope.select_rows
    monkeypatch.setattr(rope, "select_rows", lambda table, index: select(table, torch.arange(index.shape[1]).expand_as(index)))


@pytest.mark.parametrize("broken", [None, "rows_in_new_order"])
@pytest.mark.parametrize("name", ["hf_dinov3", *EVAS])
def test_tome_matches_the_reference_with_each_token_at_its_original_rotary_position(name, broken, monkeypatch):
    m = rope_model(name)
    plain = m.run()
    y, places = m.h[0], list(range(m.p, m.h.shape[1]))
    for layer, want in zip(m.stand_in.blocks, plain[1]):  # the hand-written halves are the unpatched layers
        y = m.halves.feed(layer, m.halves.attend(layer, y, None, places)[0])
        torch.testing.assert_close(y, want[0], rtol=1e-9, atol=1e-9)
    expected = tome_reference(m.stand_in, m.h, merges=[3] * 4, halves=m.halves)
    if broken:
        _rows_in_new_order(monkeypatch)
    m.patch_fn(m.model, strategy="tome", r=3)
    assert rope_matches(m, expected) == (broken is None)
    assert not torch.allclose(m.run()[0], plain[0], atol=1e-4)


@pytest.mark.parametrize("name,strategy", [("hf_dinov3", "pitome"), ("eva02", "pitome"), ("hf_dinov3", "evit"),
                                           ("timm_dinov3", "evit"), ("rope_mixed", "evit")])
def test_pitome_and_evit_match_their_references_the_fused_token_not_rotated(name, strategy):
    m = rope_model(name)
    if strategy == "pitome":
        expected = pitome_reference(m.stand_in, m.h, merges=[3] * 4, halves=m.halves)
        m.patch_fn(m.model, strategy="pitome", r=3)
    else:
        expected = evit_reference(m.stand_in, m.h, 0.5, (1, 2), halves=m.halves)
        m.patch_fn(m.model, strategy="evit", keep_rate=0.5, evit_layers=(1, 2))
    assert rope_matches(m, expected)


@pytest.mark.parametrize("mode", ["merge", "prune"])
def test_asap_on_eva_matches_its_reference(mode):
    """Merge: a pooled token at its ring's first member's position; prune with masked LLF: the
    re-inserted tokens back at their own positions."""
    m = rope_model("timm_dinov3")
    expected = asap_reference(m.stand_in, m.h, 2, 0.5, mode=mode, llf="masked", halves=m.halves)
    m.patch_fn(m.model, strategy="asap", layers=2, ratio=0.5, mode=mode, llf="masked" if mode == "prune" else False)
    assert rope_matches(m, expected)


ZERO = {"tome": dict(r=0), "pitome": dict(r=0), "evit": dict(keep_rate=1.0, evit_layers=(1, 2)),
        "asap": dict(layers=2, ratio=0.0)}


@pytest.mark.parametrize("name", list(EVAS))
def test_nothing_reduced_is_the_unpatched_eva_and_unpatch_restores_it(name):
    m = rope_model(name)
    plain = m.run()
    for strategy, options in ZERO.items():
        m.patch_fn(m.model, strategy=strategy, **options)
        final, per_layer = m.run()
        assert torch.equal(final, plain[0]) and all(torch.equal(a, b) for a, b in zip(per_layer, plain[1])), strategy
    m.patch_fn(m.model, strategy="tome", r=3)
    assert not torch.allclose(m.run()[0], plain[0], atol=1e-4)
    patch.unpatch(m.model)
    final, per_layer = m.run()
    assert torch.equal(final, plain[0]) and all(torch.equal(a, b) for a, b in zip(per_layer, plain[1]))


@pytest.mark.parametrize("name,runs_tap", [("hf_dinov3", True), ("eva02", False)])
def test_expedite_is_refused_its_cluster_tokens_have_no_rotary_position(name, runs_tap):
    runs = r"tome, evit, asap, pitome(?:, (?!expedite)\w+)*"  # and the originals added since
    m = rope_model(name)
    with pytest.raises(PullbackError, match=rf"strategy 'expedite'.*no rotary position.*runs the originals {runs} and") as refused:
        m.patch_fn(m.model, strategy="expedite", cluster_grid=(2, 2), cluster_layer=1)
    assert (", tap" in str(refused.value).split(" and the single-stage")[0]) == runs_tap
    assert patch.config(m.model) is None


def test_a_post_norm_eva_block_is_refused_by_the_methods_that_split_it():
    from timm.models.eva import Eva

    model = Eva(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, use_post_norm=True, use_rot_pos_emb=True,
                num_classes=0).eval()
    patch.timm(model, strategy="tome", r=2)
    with pytest.raises(PullbackError, match="pre-norm EvaBlock in two halves.*got EvaBlockPostNorm"):
        model.forward_features(torch.randn(1, 3, 32, 32))
