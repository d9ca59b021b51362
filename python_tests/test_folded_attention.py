"""Proportional attention folded into the dot product (``prop_attn="folded"``) against the mask form."""

from __future__ import annotations

import pytest
import torch

import pullback_ext.patch as patch
from helpers.prune import images, norm_scorer, tiny_eva, tiny_hf, tiny_vit
from pullback_ext.errors import PullbackError
from pullback_ext.prune.folded_attention import folded_sdpa

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
    """The masked-LLF mask (kept queries do not see stale keys) as two maskless calls: kept queries
    over the kept keys, stale queries over every key (how masked LLF could keep the fast kernels)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    stale = torch.zeros(9, dtype=torch.bool)
    stale[[2, 5, 6]] = True
    mask = torch.zeros(9, 9, dtype=torch.float64).masked_fill(~stale[:, None] & stale[None, :], float("-inf"))
    masked = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    kept = (~stale).nonzero()[:, 0]
    split = torch.empty_like(masked)
    split[:, :, kept] = torch.nn.functional.scaled_dot_product_attention(q[:, :, kept], k[:, :, kept], v[:, :, kept])
    split[:, :, stale] = torch.nn.functional.scaled_dot_product_attention(q[:, :, stale], k, v)
    torch.testing.assert_close(split, masked, rtol=1e-12, atol=1e-12)


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


def test_folded_is_refused_where_it_does_not_apply():
    with pytest.raises(PullbackError, match="single-stage merges"):
        patch.timm(tiny_vit(), **dict(MERGE, mode="prune", prop_attn="folded"))
    with pytest.raises(PullbackError, match="single-stage merges"):
        patch.timm(tiny_vit(), strategy="tome", r=2, prop_attn="folded")
    with pytest.raises(PullbackError, match="standard Block"):
        patch.timm(tiny_eva(), **dict(MERGE, prop_attn="folded"))
    with pytest.raises(PullbackError, match="patch.timm"):
        patch.auto(tiny_hf("vit", attn="sdpa"), **dict(MERGE, prop_attn="folded"))
    with pytest.raises(PullbackError, match="prop_attn must be"):
        patch.timm(tiny_vit(), **dict(MERGE, prop_attn="fold"))
