"""pullback_ext.patch.timm: exactness at η = 0, token counts, LLF, merging, batching, compile."""

from __future__ import annotations

import pytest
import torch

import pullback_ext.patch as patch
from pullback_ext.errors import PullbackError
from pullback_ext.prune.strategies import STRATEGIES
from helpers.prune import block_inputs, images, norm_scorer, tiny_vit

HEADS = {"importance": norm_scorer, "oracle": norm_scorer}


@pytest.mark.parametrize("mode", ["merge", "prune"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_zero_ratio_reproduces_the_unpruned_model_exactly(strategy, mode):
    model = tiny_vit(reg_tokens=1)
    x = images(2)
    ref = model.forward_features(x)
    ref_inter = model.forward_intermediates(x, indices=[1, 3])
    patch.timm(model, head=HEADS.get(strategy), ratio=0.0, layers=(1, 2), mode=mode, strategy=strategy)
    assert torch.equal(model.forward_features(x), ref)
    final, inter = model.forward_intermediates(x, indices=[1, 3])
    assert torch.equal(final, ref_inter[0])
    assert all(torch.equal(a, b) for a, b in zip(inter, ref_inter[1]))


@pytest.mark.parametrize("mode,llf", [("merge", False), ("prune", True), ("prune", False)])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_removes_exactly_r_tokens_and_keeps_prefix(strategy, mode, llf):
    model = tiny_vit(reg_tokens=2)
    x = images(3)
    plain = block_inputs(model, x)
    patch.timm(model, head=HEADS.get(strategy), ratio=0.5, layers=(1, 2), mode=mode, strategy=strategy, llf=llf)
    seen = block_inputs(model, x)
    p, n = 3, 16  # CLS + 2 registers, 16 patches: 8 removed as 4 + 4
    expected = [p + n, p + n - 4, p + n - 8, p + n if (mode == "prune" and llf) else p + n - 8]
    assert [t.shape[1] for t in seen] == expected
    # the prefix tokens reach the first stage untouched and are still first
    torch.testing.assert_close(seen[1][:, :p], plain[1][:, :p], rtol=1e-6, atol=1e-6)
    if mode == "prune":
        # kept patch tokens are distinct rows of the unreduced sequence
        dist = torch.cdist(seen[1][:, p:], plain[1][:, p:])
        assert bool((dist.min(dim=2).values == 0).all())
        assert all(len(set(dist[b].argmin(dim=1).tolist())) == n - 4 for b in range(3))


def _manual_prune(model, x, layer, count, keep_fn):
    """Reference: run blocks, drop the ``count`` lowest keep_fn tokens at ``layer``, LLF."""
    p = model.num_prefix_tokens
    h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    for i in range(layer):
        h = model.blocks[i](h)
    out = []
    for b in range(h.shape[0]):
        full = h[b:b + 1]
        order = torch.argsort(keep_fn(full[0, p:]))
        removed = sorted((order[:count] + p).tolist())
        kept = [t for t in range(full.shape[1]) if t not in removed]
        frozen = full[:, removed]
        y = full[:, kept]
        for i in range(layer, len(model.blocks) - 1):
            y = model.blocks[i](y)
        restored = torch.empty_like(full)
        restored[:, kept] = y
        restored[:, removed] = frozen
        out.append(model.blocks[-1](restored))
    return model.norm(torch.cat(out))


def test_full_llf_matches_a_hand_written_reference():
    model = tiny_vit(reg_tokens=1)
    x = images(2)
    expected = _manual_prune(model, x, layer=1, count=6, keep_fn=lambda t: t.norm(dim=-1))
    patch.timm(model, ratio=6 / 16, layers=(1,), mode="prune", strategy="norm", llf="full")
    torch.testing.assert_close(model.forward_features(x), expected, rtol=1e-5, atol=1e-5)


def test_masked_llf_leaves_kept_tokens_as_without_llf_and_updates_the_reinserted_ones():
    """Masked LLF (the default): kept tokens do not see the re-inserted ones, so their outputs are
    those without LLF; a re-inserted token attends to every token, as in full LLF."""
    model = tiny_vit(reg_tokens=1)
    x = images(2)
    outputs = {}
    for llf in (True, "full", False):
        patch.timm(model, ratio=6 / 16, layers=(1,), mode="prune", strategy="norm", llf=llf)
        outputs[llf] = model.forward_features(x)
    patch.unpatch(model)
    removed = torch.argsort(block_inputs(model, x)[1][:, 2:].norm(dim=-1), dim=1)[:, :6] + 2
    for b in range(2):
        pruned = torch.zeros(18, dtype=torch.bool).scatter(0, removed[b], True)
        torch.testing.assert_close(outputs[True][b, ~pruned], outputs[False][b, ~pruned], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outputs[True][b, pruned], outputs["full"][b, pruned], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(outputs[True][b, pruned], outputs[False][b, pruned], atol=1e-3)
        assert not torch.allclose(outputs[True][b, ~pruned], outputs["full"][b, ~pruned], atol=1e-3)


def test_llf_restores_token_order_and_frozen_features_in_intermediates():
    model = tiny_vit()
    x = images(2)
    plain = block_inputs(model, x)
    patch.timm(model, ratio=0.25, layers=(2,), mode="prune", strategy="norm", llf=True)
    seen = block_inputs(model, x)
    _, inter = model.forward_intermediates(x, indices=[1, 2], output_fmt="NLC")
    removed = torch.argsort(plain[2][:, 1:].norm(dim=-1), dim=1)[:, :4] + 1
    for b in range(2):
        # pruned tokens sit at their original positions of the last block's input, frozen
        torch.testing.assert_close(seen[3][b, removed[b]], plain[2][b, removed[b]])
        # the hooked output of block 2 carries the frozen features at the pruned positions
        torch.testing.assert_close(inter[1][b, removed[b] - 1], plain[2][b, removed[b]])
    torch.testing.assert_close(inter[0], plain[2][:, 1:])


@pytest.mark.parametrize("strategy", ["norm", "importance"])
def test_merge_matches_a_hand_written_reference(strategy):
    """Lowest-norm tokens merge into their most cosine-similar remaining patch token; averages
    are size-weighted for training-free rules and importance-weighted for ``importance``."""
    model = tiny_vit()
    x = images(2)
    h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    h = model.blocks[0](h)
    refs = []
    for b in range(2):
        tok = h[b]
        weight = tok.norm(dim=-1) if strategy == "importance" else torch.ones(17)
        src = (torch.argsort(tok[1:].norm(dim=-1))[:5] + 1).tolist()
        cand = [t for t in range(1, 17) if t not in src]
        merged = {t: [t] for t in range(17)}
        for s in src:
            sims = torch.nn.functional.cosine_similarity(tok[s][None], tok[cand], dim=-1)
            merged[cand[int(sims.argmax())]].append(s)
        rows = [(weight[merged[t]][:, None] * tok[merged[t]]).sum(0) / weight[merged[t]].sum() for t in range(17) if t not in src]
        seq = torch.stack(rows)[None]
        for blk in model.blocks[1:]:
            seq = blk(seq)
        refs.append(model.norm(seq)[:, 0])
    patch.timm(model, head=HEADS.get(strategy), ratio=5 / 16, layers=(1,), mode="merge", strategy=strategy, matching="cosine",
               prop_attn=False, selection="lowest" if strategy == "importance" else "auto",
               weights="importance" if strategy == "importance" else "auto")
    torch.testing.assert_close(model.forward_features(x)[:, 0], torch.cat(refs), rtol=1e-5, atol=1e-5)


def test_one_head_per_stage_scores_its_own_stage():
    model = tiny_vit()
    calls = []

    def scorer(name):
        def score(f):
            calls.append((name, f.shape[1]))
            return norm_scorer(f)
        return score

    patch.timm(model, head=[scorer("first"), scorer("second")], ratio=0.5, layers=(1, 2), mode="prune", strategy="importance", llf=False)
    model.forward_features(images(1))
    assert calls == [("first", 17), ("second", 13)]
    with pytest.raises(PullbackError, match="one per stage"):
        patch.timm(model, head=[norm_scorer] * 3, ratio=0.5, layers=(1, 2), mode="prune", strategy="importance")


def test_proportional_attention_equals_attending_to_duplicates():
    from pullback_ext.prune.tokens import TokenState

    model = tiny_vit()
    x = torch.randn(1, 4, 32)
    x[:, 3] = x[:, 2]  # one token twice
    state = TokenState.start(x, num_prefix=1).merge(torch.tensor([[3]]), torch.tensor([[2]]))
    reduced = model.blocks[0](state.x, attn_mask=state.attention_bias())
    torch.testing.assert_close(reduced, model.blocks[0](x)[:, :3], rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(model.blocks[0](state.x), model.blocks[0](x)[:, :3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["merge", "prune"])
@pytest.mark.parametrize("strategy", ["importance", "tome_score", "evit_score", "norm", "cls_sim", "asap_score"])
def test_batch_rows_are_independent(strategy, mode):
    model = tiny_vit(reg_tokens=1)
    x = images(3)
    patch.timm(model, head=HEADS.get(strategy), ratio=0.4, layers=(1, 2), mode=mode, strategy=strategy, prop_attn=mode == "merge")
    batched = model.forward_features(x)
    single = torch.cat([model.forward_features(x[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(batched, single, rtol=1e-4, atol=1e-5)


def test_fused_and_math_attention_agree():
    model = tiny_vit()
    x = images(2)
    assert all(blk.attn.fused_attn for blk in model.blocks)
    patch.timm(model, ratio=0.5, layers=(1,), mode="merge", strategy="evit_score", prop_attn=True)
    fused = model.forward_features(x)
    for blk in model.blocks:
        blk.attn.fused_attn = False
    torch.testing.assert_close(model.forward_features(x), fused, rtol=1e-4, atol=1e-5)


def test_unpatch_restores_the_model_and_keeps_its_state_dict():
    model = tiny_vit()
    x = images(2)
    ref = model(x)
    keys = list(model.state_dict())
    patch.timm(model, ratio=0.5, layers=(1,), mode="prune", strategy="tome_score")
    assert not torch.equal(model(x), ref)
    assert list(model.state_dict()) == keys
    patch.timm(model, ratio=0.5, layers=(2,), mode="merge", strategy="norm")  # re-patch replaces
    assert patch.config(model).layers == (2,) and patch.config(model).mode == "merge"
    patch.unpatch(model)
    assert torch.equal(model(x), ref)
    assert "forward_features" not in vars(model) and patch.config(model) is None
    patch.unpatch(model)  # no-op


def test_torch_compile_runs_a_patched_model():
    model = tiny_vit(depth=3)
    x = images(2)
    patch.timm(model, ratio=0.5, layers=(1,), mode="prune", strategy="norm", llf=True)
    eager = model(x)
    compiled = torch.compile(model, backend="eager" if not hasattr(torch, "_inductor") else "inductor")
    torch.testing.assert_close(compiled(x), eager, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(ratio=1.0), r"ratio must lie in \[0, 1\)"),
        (dict(ratio=-0.1), r"ratio must lie in \[0, 1\)"),
        (dict(ratio=float("nan")), r"ratio must lie in \[0, 1\)"),
        (dict(ratio="0.3"), "ratio must be a float"),
        (dict(ratio=(0.6, 0.5), layers=(1, 2)), "add up to less than 1"),
        (dict(ratio=(0.1,), layers=(1, 2)), "ratio has 1 entries but layers has 2"),
        (dict(layers=(4,)), r"layers must lie in \[0, 3\] for this 4-block model"),
        (dict(layers=(3,), mode="prune", llf=True), "LLF"),
        (dict(layers=(2, 1)), "strictly increasing"),
        (dict(layers=()), "at least one"),
        (dict(layers=(1.5,)), "block indices"),
        (dict(mode="drop"), "mode must be one of"),
        (dict(strategy="magic"), "strategy must be one of"),
        (dict(strategy="importance"), "needs head="),
        (dict(strategy="oracle"), "needs head="),
        (dict(strategy="evit_score", layers=(0,)), "layers must start at 1"),
        (dict(strategy="norm", matching="pullback"), "needs spn="),
        (dict(strategy="norm", weights="importance"), "weights='importance' needs"),
        (dict(strategy="norm", selection="bound"), "selection='bound' needs"),
        (dict(strategy="norm", prop_attn="sometimes"), "prop_attn must be"),
        (dict(strategy="norm", mode="prune", llf="partial"), "llf must be"),
    ],
)
def test_invalid_options_give_clear_errors(kwargs, match):
    model = tiny_vit()
    kwargs = dict(dict(strategy="norm", mode="merge", layers=(1,)), **kwargs)
    with pytest.raises(PullbackError, match=match):
        patch.timm(model, **kwargs)
    assert patch.config(model) is None


def test_cls_strategies_need_a_class_token_and_models_must_be_vits():
    with pytest.raises(PullbackError, match="needs a class token"):
        patch.timm(tiny_vit(class_token=False), strategy="evit_score", layers=(1,))
    with pytest.raises(PullbackError, match="timm VisionTransformer"):
        patch.timm(torch.nn.Linear(3, 3), strategy="norm")


def test_scorer_with_a_wrong_shape_is_reported():
    model = tiny_vit()
    patch.timm(model, head=lambda F: F.norm(dim=-1)[:, 1:], strategy="importance", layers=(1,))
    with pytest.raises(PullbackError, match="must return scores of shape"):
        model(images(1))


def test_random_strategy_is_seeded():
    model = tiny_vit()
    x = images(2)
    outs = []
    for seed in (0, 0, 1):
        patch.timm(model, ratio=0.5, layers=(1,), mode="prune", strategy="random", seed=seed)
        outs.append(model.forward_features(x))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_pullback_matching_with_an_spn_differs_from_cosine_and_keeps_rows_independent():
    from pullback_ext.metric.spn import SPN

    torch.manual_seed(0)
    spn = SPN(dim=32, rank=3, hidden=8, heads=2).eval().requires_grad_(False)
    model = tiny_vit()
    x = images(3)
    patch.timm(model, head=spn, ratio=0.5, layers=(1,), mode="merge", strategy="importance", spn=spn)
    assert patch.config(model).matching == "pullback"
    pulled = model.forward_features(x)
    torch.testing.assert_close(pulled, torch.cat([model.forward_features(x[i:i + 1]) for i in range(3)]), rtol=1e-4, atol=1e-5)
    patch.timm(model, head=spn, ratio=0.5, layers=(1,), mode="merge", strategy="importance", matching="cosine")
    assert not torch.allclose(model.forward_features(x), pulled)



def _random_biases(model):
    """``model`` with Eva's separate query and value biases (zeros at timm's init) random."""
    with torch.no_grad():
        for block in model.blocks:
            for name in ("q_bias", "v_bias"):
                if getattr(block.attn, name, None) is not None:
                    getattr(block.attn, name).normal_(0.0, 0.5)
    return model


def _gated(model):
    """``model`` with a sigmoid gate and a norm on every attention output."""
    for block in model.blocks:
        block.attn.gate = torch.nn.Linear(32, 32).double()
        block.attn.norm = torch.nn.LayerNorm(32).double()
    return model


def _timm_split_model(name: str, size: int):
    from helpers.blocks import small_timm
    from helpers.prune import tiny_eva

    if name == "tiny_vit":
        return tiny_vit().double()
    if name == "gated_vit":
        return _gated(tiny_vit().double())
    if name == "eva_gqa":
        from timm.models.eva import Eva

        torch.manual_seed(0)
        return _gated(Eva(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_kv_heads=2, qkv_fused=False,
                          attn_type="rope", use_rot_pos_emb=True, init_values=0.5, num_classes=0).double().eval())
    return _random_biases((tiny_eva if "eva" in name or "rope" in name or "dinov3" in name else small_timm)(name, size))


@pytest.mark.parametrize("name,size", [("tiny_vit", 32), ("gated_vit", 32), ("deit3_small_patch16_224", 64),
                                       ("eva02_tiny_patch14_224", 56), ("vit_small_patch16_rope_mixed_224", 64),
                                       ("vit_small_patch16_dinov3", 64), ("eva_gqa", 32)])
def test_the_attention_half_with_its_own_probabilities_given_is_the_attention_half(name, size):
    """``attend_with(block, x, softmax(scale q kᵀ))`` is ``attend(block, state, None).x``: LayerScale,
    gated and normed attention outputs, Eva's fused (with separate biases) or separate projections,
    grouped-query attention, rotated queries and keys (whose rotation the given probabilities carry)."""
    from pullback_ext.prune import timm_vit
    from pullback_ext.prune.merged_tokens import MergedTokens

    model = _timm_split_model(name, size)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens, runner = timm_vit._embed(model, x)
    for block in model.blocks[:2]:
        attended = runner.split.attend(block, MergedTokens(tokens, int(model.num_prefix_tokens)), None)
        probs = ((attended.q * attended.scale) @ attended.k.transpose(-2, -1)).softmax(dim=-1)
        torch.testing.assert_close(runner.split.attend_with(block, tokens, probs), attended.x, rtol=1e-12, atol=1e-12)
        tokens = runner.split.feed_forward(block, attended.x)
