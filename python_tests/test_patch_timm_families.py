"""pullback_ext.patch.timm on timm ``Eva`` models (EVA-02, a "mixed" RoPE ViT, timm's DINOv3 with
registers) and on timm ViTs with LayerScale (DINOv2-style, DeiT-III) for the single-stage
strategies (the originals on Eva: test_rope_originals.py): exactness at ratio 0, hand-written references of prune (full LLF) and merge with the
rotary rows of the kept tokens, attention, unpatching."""

from __future__ import annotations

import pytest
import torch

import pullback_ext.patch as patch
from helpers.blocks import small_timm
from helpers.prune import attention_prune_reference, norm_merge_reference, norm_prune_full_llf_reference, tiny_eva
from pullback_ext.errors import PullbackError
from pullback_ext.families import detect
from pullback_ext.prune import timm_eva
from pullback_ext.prune.strategies import STRATEGIES

EVAS = [("eva02_tiny_patch14_224", 56), ("vit_small_patch16_rope_mixed_224", 64), ("vit_small_patch16_dinov3", 64)]
LAYER_SCALE = [("vit_small_patch14_dinov2", 56), ("deit3_small_patch16_224", 64), ("vit_small_patch14_reg4_dinov2", 56)]

OTHER_ORIGINALS = r"(?:, (?!expedite)\w+)*"  # originals added since, never expedite


def pixels(size: int, n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def parts(model, x: torch.Tensor):
    """``(input of block 0 [B, N, D], call(block, y, kept), rotary rows(block, kept))`` of an
    unpatched ViT or Eva; ``kept`` are the positions of the tokens ``y``."""
    p = int(model.num_prefix_tokens)
    if not detect(model).rotary:
        h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
        return h, lambda block, y, kept: block(y), None
    h, rope = model._pos_embed(model.patch_embed(x))
    index = {id(block): i for i, block in enumerate(model.blocks)}

    def rows(block, kept):
        table = rope[index[id(block)]] if model.rope_mixed else rope
        return table[..., [t - p for t in kept if t >= p], :]

    return model.norm_pre(h), lambda block, y, kept: block(y, rope=rows(block, kept)), rows


@pytest.mark.parametrize("name,size", EVAS + LAYER_SCALE)
def test_zero_ratio_is_exact_and_unpatch_restores(name, size):
    model = tiny_eva(name, size) if (name, size) in EVAS else small_timm(name, size, depth=4)
    x = pixels(size)
    ref, (ref_final, ref_inter) = model.forward_features(x), model.forward_intermediates(x, indices=[1, 3])
    for strategy in ("tome_score", "evit_score", "asap_score"):
        patch.timm(model, ratio=0.0, layers=(1, 2), strategy=strategy)
        final, inter = model.forward_intermediates(x, indices=[1, 3])
        assert torch.equal(model.forward_features(x), ref) and torch.equal(final, ref_final)
        assert all(torch.equal(a, b) for a, b in zip(inter, ref_inter))
    patch.timm(model, ratio=0.5, layers=(1, 2), mode="merge", strategy="tome_score")
    assert not torch.allclose(model.forward_features(x), ref, atol=1e-4)
    assert model.forward_features(x).shape == ref.shape
    patch.unpatch(model)
    assert torch.equal(model.forward_features(x), ref)


@pytest.mark.parametrize("name,size", EVAS + LAYER_SCALE)
def test_prune_with_full_llf_matches_a_hand_written_reference(name, size):
    """Pruned tokens are frozen and re-inserted at their own positions (their own rotary rows)."""
    model = tiny_eva(name, size) if (name, size) in EVAS else small_timm(name, size, depth=4)
    x = pixels(size)
    h0, call, _ = parts(model, x)
    p = int(model.num_prefix_tokens)
    h1 = call(model.blocks[0], h0, list(range(h0.shape[1])))
    expected, _ = norm_prune_full_llf_reference(h1, model.blocks[1:3], model.blocks[3], 6, p, call)
    patch.timm(model, ratio=6 / 16, layers=(1,), mode="prune", strategy="norm", llf="full")
    torch.testing.assert_close(model.forward_features(x), model.norm(expected), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name,size", EVAS + LAYER_SCALE)
def test_merge_matches_a_hand_written_reference(name, size):
    """A merged token is at its destination: the destination's rotary rows."""
    model = tiny_eva(name, size) if (name, size) in EVAS else small_timm(name, size, depth=4)
    x = pixels(size)
    h0, call, _ = parts(model, x)
    h1 = call(model.blocks[0], h0, list(range(h0.shape[1])))
    expected = norm_merge_reference(h1, model.blocks[1:], 5, int(model.num_prefix_tokens), call)
    patch.timm(model, ratio=5 / 16, layers=(1,), mode="merge", strategy="norm", matching="cosine", prop_attn=False)
    torch.testing.assert_close(model.forward_features(x), model.norm(expected), rtol=1e-9, atol=1e-9)


def probabilities(block, y: torch.Tensor, rope) -> torch.Tensor:
    """The block's own head-averaged attention ``[B, K, K]``, caught after its softmax (unfused path)."""
    seen = []
    block.attn.fused_attn = False
    hook = block.attn.attn_drop.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        block(y, rope=rope)
    finally:
        hook.remove()
        block.attn.fused_attn = True
    return seen[0].mean(dim=1)


@pytest.mark.parametrize("name,size", EVAS)
def test_eva_attention_strategies_read_each_stage_with_the_current_positions(name, size):
    """evit_score over two consecutive stages (the attention of block 1 on the tokens kept at stage
    1, with their own rotary rows), against the blocks' own attention."""
    model = tiny_eva(name, size)
    x = pixels(size)
    h0, call, rows = parts(model, x)
    p = int(model.num_prefix_tokens)
    h1 = call(model.blocks[0], h0, list(range(h0.shape[1])))
    torch.testing.assert_close(timm_eva.attention_probs(model.blocks[1], h1, None, rows(model.blocks[1], range(h1.shape[1]))),
                               probabilities(model.blocks[1], h1, rows(model.blocks[1], range(h1.shape[1]))))
    expected = attention_prune_reference(h0, model.blocks, call, lambda block, y, kept: probabilities(block, y, rows(block, kept)),
                                         (1, 2), 4, p)
    patch.timm(model, ratio=(4 / 16, 4 / 16), layers=(1, 2), mode="prune", strategy="evit_score", llf=False)
    torch.testing.assert_close(model.forward_features(x), model.norm(expected), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_single_stage_strategy_runs_on_eva_and_expedite_is_refused(strategy):
    model = tiny_eva("vit_small_patch16_dinov3", 64)
    x = pixels(64)
    head = (lambda f: f.norm(dim=-1)) if strategy in ("importance", "oracle") else None
    for mode in ("merge", "prune"):
        patch.timm(model, head=head, ratio=0.5, layers=(1, 2), mode=mode, strategy=strategy)
        final, inter = model.forward_intermediates(x, indices=[1, 2], output_fmt="NLC")
        assert final.shape == (2, 21, 384) and all(t.shape == (2, 16, 384) for t in inter)
    with pytest.raises(PullbackError, match=rf"strategy 'expedite'.*Eva.*no rotary position.*runs the originals tome, evit, "
                                            rf"asap, pitome{OTHER_ORIGINALS} and the single-stage strategies"):
        patch.timm(model, strategy="expedite", cluster_grid=(2, 2), cluster_layer=1)
