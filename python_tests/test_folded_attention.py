"""``prop_attn="folded"``: proportional attention folded into the dot product, and masked LLF as two
maskless attention calls, against the mask forms."""

from __future__ import annotations

import pytest
import torch

import pullback_ext.patch as patch
from helpers.prune import images, norm_scorer, tiny_eva, tiny_hf, tiny_vit
from pullback_ext.errors import PullbackError
from pullback_ext.prune.folded_attention import StaleKeys, folded_sdpa, two_call_sdpa

MERGE = dict(strategy="importance", head=norm_scorer, ratio=0.5, layers=(1,), mode="merge")


def log_size_mask_attention(q, k, v, log_sizes, scale):
    """The reference: ``softmax(scale·q kᵀ + log s) v`` written out, no SDPA."""
    logits = scale * q @ k.transpose(-2, -1) + log_sizes[:, None, None, :]
    return logits.softmax(-1) @ v


@pytest.mark.parametrize("head_dim", [16, 64, 7])
def test_the_fold_equals_the_log_size_bias(head_dim):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 11, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
    log_sizes = torch.randint(1, 9, (2, 11), generator=g).double().log()
    scale = head_dim ** -0.5
    expected = log_size_mask_attention(q, k, v, log_sizes, scale)
    torch.testing.assert_close(folded_sdpa(q, k, v, log_sizes, scale), expected, rtol=1e-12, atol=1e-12)
    # the scale must be the original one: SDPA's default for the padded width is another
    assert not torch.allclose(folded_sdpa(q, k, v, log_sizes, (head_dim + 1) ** -0.5), expected, atol=1e-6)


def test_masked_llf_equals_two_maskless_attention_calls():
    """The masked-LLF mask (kept queries do not see stale keys) against two maskless calls: kept
    queries over the kept keys, stale queries over every key, each image with its own stale tokens."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    stale = torch.zeros(2, 9, dtype=torch.bool)
    stale[0, [2, 5, 6]] = stale[1, [1, 3, 8]] = True
    mask = torch.zeros(2, 1, 9, 9, dtype=torch.float64).masked_fill((~stale[:, :, None] & stale[:, None, :])[:, None], float("-inf"))
    masked = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    keys = StaleKeys(torch.argsort(stale.to(torch.int8), dim=1, stable=True), 6)
    torch.testing.assert_close(two_call_sdpa(q, k, v, keys, 8 ** -0.5), masked, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(keys.as_mask().double(), mask)
    wrong = StaleKeys(keys.order, 7)  # one stale token counted as kept: it then attends to the kept tokens only
    assert not torch.allclose(two_call_sdpa(q, k, v, wrong, 8 ** -0.5), masked, atol=1e-6)


@pytest.mark.parametrize("layers", [(1,), (1, 2, 3)])
def test_a_folded_patched_vit_equals_the_masked_one(layers):
    model = tiny_vit(reg_tokens=1).double()
    x = images(3).double()
    patch.timm(model, **dict(MERGE, layers=layers, prop_attn=True))
    masked = model.forward_features(x)
    patch.timm(model, **dict(MERGE, layers=layers, prop_attn="folded"))
    folded = model.forward_features(x)
    torch.testing.assert_close(folded, masked, rtol=1e-10, atol=1e-10)
    patch.timm(model, **dict(MERGE, layers=layers, prop_attn=False))
    assert not torch.allclose(model.forward_features(x), masked, atol=1e-6)  # the bias matters here


@pytest.mark.parametrize("layers", [(1,), (1, 2)])
def test_a_folded_masked_llf_equals_the_masked_one(layers):
    model = tiny_vit(reg_tokens=1).double()
    x = images(3).double()
    prune = dict(MERGE, mode="prune", layers=layers, llf="masked")
    masked = patch.timm(model, **prune).forward_features(x)
    folded = patch.timm(model, **dict(prune, prop_attn="folded")).forward_features(x)
    torch.testing.assert_close(folded, masked, rtol=1e-10, atol=1e-10)
    full = patch.timm(model, **dict(prune, llf="full")).forward_features(x)
    assert not torch.allclose(full, masked, atol=1e-6)  # the mask matters here


def test_folded_is_refused_where_it_does_not_apply():
    with pytest.raises(PullbackError, match="needs llf='masked', got llf='full'"):
        patch.timm(tiny_vit(), **dict(MERGE, mode="prune", llf="full", prop_attn="folded"))
    with pytest.raises(PullbackError, match="single-stage strategies"):
        patch.timm(tiny_vit(), strategy="tome", r=2, prop_attn="folded")
    with pytest.raises(PullbackError, match="standard Block"):
        patch.timm(tiny_eva(), **dict(MERGE, prop_attn="folded"))
    with pytest.raises(PullbackError, match="patch.timm"):
        patch.auto(tiny_hf("vit", attn="sdpa"), **dict(MERGE, prop_attn="folded"))
    with pytest.raises(PullbackError, match="prop_attn must be"):
        patch.timm(tiny_vit(), **dict(MERGE, prop_attn="fold"))
