"""Selection strategies, matching and token bookkeeping against independent reference code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune.matching import merge_drift, nearest_destinations, patch_distances, pullback_distances, select_with_partners
from pullback_ext.prune.methods.single_stage import apply_stage
from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions
from pullback_ext.prune.schedules import scale_layers
from pullback_ext.prune.strategies import StageContext, lowest, make_strategy
from pullback_ext.prune.tokens import TokenState, split_budget
from helpers.prune import images, tiny_vit


def _resolved(depth: int, num_prefix: int = 1, **options):
    """The reduction of ``options`` for a backbone of ``depth`` blocks with a class token."""
    return ReductionOptions(**options).resolve(BackboneShape(depth=depth, num_prefix=num_prefix, has_cls=True))


def _tokens(b=2, k=11, d=6, seed=0):
    return torch.randn(b, k, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_tome_score_matches_a_loop_reference():
    x = _tokens()
    scores = make_strategy("tome_score").keep_scores(StageContext(x=x, num_prefix=1, has_cls=True))
    removed = lowest(scores, 4, 1)
    for b in range(2):
        t = x[b, 1:].numpy()
        t = t / np.linalg.norm(t, axis=1, keepdims=True)
        a_idx, b_idx = list(range(0, 10, 2)), list(range(1, 10, 2))
        best = {i: max(float(t[i] @ t[j]) for j in b_idx) for i in a_idx}
        expected = sorted(a_idx, key=lambda i: -best[i])[:4]
        assert sorted((removed[b] - 1).tolist()) == sorted(expected)
    # beyond |A|, B tokens follow
    removed = lowest(scores, 7, 1)
    assert all(set(range(1, 11, 2)) <= set(r.tolist()) for r in removed)


def test_evit_uses_head_averaged_cls_attention_of_the_block_before_the_stage():
    from pullback_ext.prune.timm_vit import attention_probs

    model = tiny_vit()
    x = model.norm_pre(model._pos_embed(model.patch_embed(images(2))))
    captured = []
    blk = model.blocks[0]
    blk.attn.fused_attn = False
    handle = blk.attn.attn_drop.register_forward_hook(lambda m, i, o: captured.append(o))
    blk(x)
    handle.remove()
    torch.testing.assert_close(attention_probs(blk, x, None), captured[0].mean(1))
    ctx = StageContext(x=x, num_prefix=1, has_cls=True, attentions=[captured[0].mean(1)])
    torch.testing.assert_close(make_strategy("evit_score").keep_scores(ctx), captured[0].mean(1)[:, 0, 1:])


def test_asap_score_matches_a_numpy_reference():
    g = torch.Generator().manual_seed(3)
    attn = [torch.softmax(torch.randn(2, 9, 9, generator=g) * 2, dim=-1) for _ in range(3)]
    x = torch.randn(2, 9, 4, generator=g)
    got = make_strategy("asap_score").keep_scores(StageContext(x=x, num_prefix=1, has_cls=True, attentions=attn))
    removed = lowest(got, 7, 1)  # all patch tokens but one
    sinks = []
    for b in range(2):
        T = np.eye(9)
        for a in attn:
            T = (0.5 * np.eye(9) + 0.5 * a[b].double().numpy()) @ T
        mass = T.sum(0)
        s = int(mass.argmax())
        pi = mass / 9
        d = np.sqrt((((T - T[s]) / np.sqrt(pi)) ** 2).sum(1))
        d[s] = np.inf  # the sink is the anchor: never removed before every other patch token
        np.testing.assert_allclose(got[b].numpy(), d[1:], rtol=1e-5, atol=1e-6)
        assert s not in removed[b].tolist()
        sinks.append(s)
    assert any(s >= 1 for s in sinks)  # a patch-token sink was protected


def test_norm_and_cls_similarity_scores():
    x = _tokens()
    ctx = StageContext(x=x, num_prefix=2, has_cls=True)
    np.testing.assert_allclose(make_strategy("norm").keep_scores(ctx).numpy(), np.linalg.norm(x[:, 2:].numpy(), axis=-1), rtol=1e-6)
    xn = x.numpy()
    cos = np.einsum("bkd,bd->bk", xn[:, 2:], xn[:, 0]) / (np.linalg.norm(xn[:, 2:], axis=-1) * np.linalg.norm(xn[:, 0], axis=-1)[:, None])
    np.testing.assert_allclose(make_strategy("cls_sim").keep_scores(ctx).numpy(), cos, rtol=1e-5)


def test_importance_strategy_accepts_an_spn_output():
    from pullback_ext.metric.spn import SPN

    torch.manual_seed(0)
    spn = SPN(dim=6, rank=3, hidden=8, heads=2).eval()
    x = _tokens().float()
    strat = make_strategy("importance", spn)
    with torch.no_grad():
        u, lam = spn(x)
        expected = (u.view(2, 11, 6, 3).square().sum(2) * lam[:, None]).sum(-1).sqrt()
        torch.testing.assert_close(strat.keep_scores(StageContext(x=x, num_prefix=1, has_cls=True)), expected[:, 1:])


def test_pullback_distance_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    b, k, d, r = 2, 7, 5, 3
    x = torch.randn(b, k, d, generator=g, dtype=torch.float64)
    u = torch.linalg.qr(torch.randn(b, k * d, r, generator=g, dtype=torch.float64)).Q
    lam = torch.rand(b, r, generator=g, dtype=torch.float64) + 0.1
    src = torch.tensor([[3, 5], [1, 6]])
    eps = 0.01
    got = pullback_distances(x, src, u, lam, eps)
    for bb in range(b):
        for i, s in enumerate(src[bb].tolist()):
            us = u[bb].view(k, d, r)[s]
            for t in range(k):
                delta = x[bb, s] - x[bb, t]
                ref = float((lam[bb] * (delta @ us) ** 2).sum() + eps * delta.square().sum())
                assert abs(float(got[bb, i, t]) - ref) < 1e-5 * max(1.0, ref)


@pytest.mark.parametrize("matching", ["pullback", "cosine"])
def test_destinations_are_never_prefix_or_sources(matching):
    x = _tokens(k=9).float()
    src = torch.tensor([[2, 3, 4], [8, 7, 1]])

    def spn(f):
        b, k, d = f.shape
        return torch.linalg.qr(torch.randn(b, k * d, 2, generator=torch.Generator().manual_seed(0))).Q, torch.ones(b, 2)

    # a prefix token identical to a source would win any nearest-neighbour search
    x[:, 0] = x[:, 2]
    dst = nearest_destinations(x, src, num_prefix=1, matching=matching, spn=spn)
    for b in range(2):
        assert not set(dst[b].tolist()) & (set(src[b].tolist()) | {0})


@pytest.mark.parametrize("matching", ["pullback", "cosine"])
def test_merge_drift_matches_brute_force(matching):
    x = _tokens(b=2, k=8, d=5)
    x[:, 5] = x[:, 3]  # an exact duplicate moves nowhere when merged
    x[:, 0] = x[:, 6]  # a prefix twin must not count as a destination
    g = torch.Generator().manual_seed(1)
    u = torch.linalg.qr(torch.randn(2, 8 * 5, 3, generator=g, dtype=torch.float64)).Q
    lam = torch.rand(2, 3, generator=g, dtype=torch.float64) + 0.5

    def spn(f):
        return u, lam

    got, nearest = merge_drift(x, 1, matching, spn=spn, eps=1e-3)
    assert bool((nearest >= 1).all()) and bool((nearest != torch.arange(1, 8)).all())
    for b in range(2):
        for i, s in enumerate(range(1, 8)):
            others = [t for t in range(1, 8) if t != s]
            if matching == "pullback":
                us = u[b].view(8, 5, 3)[s]
                d2 = [float((lam[b] * ((x[b, s] - x[b, t]) @ us) ** 2).sum() + 1e-3 * (x[b, s] - x[b, t]).square().sum()) for t in others]
                assert float(got[b, i]) == pytest.approx(min(d2) ** 0.5, rel=1e-5, abs=1e-6)  # float32 distances
            else:
                cos = [float(torch.nn.functional.cosine_similarity(x[b, s], x[b, t], dim=0)) for t in others]
                t = others[int(np.argmax(cos))]
                assert float(got[b, i]) == pytest.approx(float((x[b, s] - x[b, t]).norm()), abs=1e-12)
    assert got[:, 2].abs().max() < 1e-3 and got[:, 4].abs().max() < 1e-3  # tokens 3 and 5 (eps floor aside, no move)


def _greedy_reference(cost, nearest, count):
    """Loop version of select_with_partners for one image (patch-relative indices)."""
    chosen, protected = [], set()
    for t in sorted(range(len(cost)), key=lambda i: (cost[i], i)):
        if len(chosen) < count and t not in protected:
            chosen.append(t)
            protected.add(nearest[t])
    for t in sorted(range(len(cost)), key=lambda i: (cost[i], i)):
        if len(chosen) < count and t not in chosen:
            chosen.append(t)
    return sorted(chosen)


@pytest.mark.parametrize("matching", ["pullback", "cosine"])
def test_bound_merge_runs_the_matching_once_and_reuses_it_for_destinations(matching):
    x = _tokens(b=2, k=9, d=4)
    g = torch.Generator().manual_seed(2)
    u = torch.linalg.qr(torch.randn(2, 9 * 4, 2, generator=g, dtype=torch.float64)).Q
    calls = []

    def spn(f):
        calls.append(f.shape)
        return u, torch.ones(2, 2, dtype=torch.float64)

    src = torch.tensor([[1, 4, 7], [8, 2, 3]])
    direct = nearest_destinations(x, src, 1, matching, spn=spn, eps=0.0)
    shared = nearest_destinations(x, src, 1, matching, patch_dist=patch_distances(x, 1, matching, spn=spn, eps=0.0))
    assert torch.equal(direct, shared)

    cfg = _resolved(depth=2, head=lambda f: f.norm(dim=-1), ratio=3 / 8, layers=(1,), mode="merge", strategy="importance",
                    spn=spn if matching == "pullback" else None, matching=matching)
    calls.clear()
    merged = apply_stage(cfg, TokenState.start(x, 1), 3, [])
    assert merged.x.shape[1] == 6 and len(calls) == (1 if matching == "pullback" else 0)


def test_select_with_partners_matches_a_loop_reference():
    g = torch.Generator().manual_seed(3)
    for count in (1, 3, 6, 9):
        cost = torch.rand(4, 10, generator=g, dtype=torch.float64)
        nearest = torch.randint(0, 10, (4, 10), generator=g) + 2  # indices into a sequence with 2 prefix tokens
        got = select_with_partners(cost, nearest, count, num_prefix=2)
        for b in range(4):
            expected = _greedy_reference(cost[b].tolist(), (nearest[b] - 2).tolist(), count)
            assert sorted((got[b] - 2).tolist()) == expected


def test_bound_selection_merges_the_lowest_importance_times_drift():
    x = _tokens(b=1, k=7, d=4)
    x[:, 4] = x[:, 2] * 1.0001  # token 4 sits next to token 2: tiny drift despite high importance
    importance = torch.tensor([[10.0, 1.0, 9.0, 0.5, 8.0, 0.6, 7.0]], dtype=x.dtype)

    def head(f):
        return importance.expand(f.shape[0], -1)

    drift, nearest = merge_drift(x, 1, "cosine")
    expected = [t + 1 for t in _greedy_reference((importance[0, 1:] * drift[0]).tolist(), (nearest[0] - 1).tolist(), 2)]
    assert 4 in expected and 2 not in expected  # the near-duplicate goes, its twin stays as the destination
    common = dict(depth=2, head=head, ratio=2 / 6, layers=(1,), mode="merge", strategy="importance")
    bound = _resolved(**common)
    assert bound.options.selection == "bound" and bound.options.prop_attn
    for cfg, want in ((bound, expected), (_resolved(**common, selection="lowest"), [3, 5])):
        calls = []
        state = TokenState.start(x, 1)
        merge = state.merge
        state.merge = lambda src, dst, w=None: calls.append((src, dst)) or merge(src, dst, w)
        apply_stage(cfg, state, 2, [])
        assert sorted(calls[0][0][0].tolist()) == want
    assert calls[0][1] is not None


def test_selection_and_prop_attn_options_are_validated():
    common = dict(depth=4, ratio=0.2, layers=(1,))
    assert _resolved(**common, mode="prune", strategy="tome_score").options.selection == "lowest"
    assert not _resolved(**common, mode="prune", strategy="tome_score").options.prop_attn
    assert _resolved(**common, mode="merge", strategy="tome_score").options.prop_attn
    with pytest.raises(PullbackError, match="selection='bound' needs mode='merge'"):
        _resolved(**common, mode="merge", strategy="tome_score", selection="bound")
    with pytest.raises(PullbackError, match="selection must be one of"):
        _resolved(**common, mode="merge", strategy="tome_score", selection="best")
    with pytest.raises(PullbackError, match="prop_attn must be"):
        _resolved(**common, mode="merge", strategy="tome_score", prop_attn="yes")


def test_token_state_merge_tracks_sizes_weights_and_owner():
    x = _tokens(b=1, k=6, d=3)
    state = TokenState.start(x, num_prefix=1)
    w = torch.tensor([[1.0, 1.0, 2.0, 1.0, 3.0, 1.0]], dtype=x.dtype)
    merged = state.merge(torch.tensor([[2, 4]]), torch.tensor([[1, 1]]), weights=w)
    expected = (x[0, 1] * 1 + x[0, 2] * 2 + x[0, 4] * 3) / 6
    torch.testing.assert_close(merged.x[0, 1], expected)
    assert merged.sizes.tolist() == [[1.0, 3.0, 1.0, 1.0]]
    assert merged.owner.tolist() == [[0, 1, 1, 2, 1, 3]]
    again = merged.merge(torch.tensor([[3]]), torch.tensor([[1]]))
    assert again.sizes.tolist() == [[1.0, 4.0, 1.0]]
    assert again.owner.tolist() == [[0, 1, 1, 2, 1, 1]]
    torch.testing.assert_close(again.full()[0, 5], again.x[0, 1])


def test_token_state_prune_then_full_is_the_identity():
    x = _tokens(b=2, k=8, d=3)
    state = TokenState.start(x, 2).prune(torch.tensor([[5, 2], [7, 3]])).prune(torch.tensor([[2, 4], [2, 5]]))
    assert state.x.shape[1] == 4
    assert torch.equal(state.full(), x)
    assert torch.equal(state.restore().x, x)


def test_split_budget_and_schedules():
    assert split_budget(196, 0.5, 2) == [49, 49]
    assert split_budget(196, 0.3, 4) == [15, 15, 15, 14]
    assert sum(split_budget(197, 0.37, 3)) == round(0.37 * 197)
    assert split_budget(100, (0.1, 0.2), 2) == [10, 20]
    assert scale_layers((4, 8), 12) == (4, 8)
    assert scale_layers((1, 4, 7, 10), 12) == (1, 4, 7, 10)
    assert scale_layers((4, 8), 8) == (2, 5)
    assert scale_layers("4stage", 24) == (2, 9, 15, 22)
    assert all(max(scale_layers("4stage", d)) <= d - 2 for d in range(6, 40))


def test_oracle_scorer_gives_the_closed_form_imp_star_and_drives_selection():
    """ψ(F) = Σ_t a_t W x_t has J_{:,t} = a_t W, so imp*(t) = |a_t| ‖W‖_F (rank(J) = 3 <= r)."""
    import pullback_ext.patch as patch
    from pullback_ext.probes.callable_probe import from_callable
    from pullback_ext.prune.oracle import OracleScorer

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 32, generator=g)
    a = torch.rand(17, generator=g) + 0.1
    probe = from_callable(lambda F: torch.einsum("t,btd,cd->bc", a, F, w), torch.zeros(17, 32), layer=0, num_prefix_tokens=1)
    oracle = OracleScorer(probe, rank=3, power=1)
    features = torch.randn(2, 17, 32, generator=g)
    expected = (a.abs() * w.norm()).expand(2, 17)
    torch.testing.assert_close(oracle(features), expected, rtol=1e-4, atol=1e-4)

    model = tiny_vit()
    patch.timm(model, head=oracle, ratio=0.25, layers=(1,), mode="prune", strategy="oracle", llf=False)
    seen = []
    handle = model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    model.forward_features(images(1))
    handle.remove()
    plain = model.blocks[0](model.norm_pre(model._pos_embed(model.patch_embed(images(1)))))
    kept = [t for t in range(17) if t == 0 or t not in (torch.argsort(a[1:])[:4] + 1).tolist()]
    torch.testing.assert_close(seen[0], plain[:, kept])


def test_an_spn_scorer_with_negative_energies_is_refused_in_eager_forwards():
    from pullback_ext.prune.strategies import ScorerStrategy

    def bad_spn(x):
        b, k, d = x.shape
        return torch.ones(b, k * d, 2, dtype=x.dtype), -torch.ones(b, 2, dtype=x.dtype)

    with pytest.raises(Exception, match="lam"):
        ScorerStrategy("importance", bad_spn).importance(torch.rand(1, 5, 3, dtype=torch.float64))


def test_random_scores_are_uniform_seeded_and_differ_per_image_and_stage():
    from scipy import stats

    from pullback_ext.prune.strategies import hashed_uniform

    u = hashed_uniform(32, 500, 7, "cpu", torch.float64)
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3 and 0 <= float(u.min()) and float(u.max()) < 1
    assert torch.equal(u, hashed_uniform(32, 500, 7, "cpu", torch.float64))
    assert not torch.equal(u[0], u[1]) and not torch.equal(u, hashed_uniform(32, 500, 8, "cpu", torch.float64))
    assert abs(float(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1])) < 0.02
    assert hashed_uniform(2, 3, 2**80, "cpu", torch.float32).dtype == torch.float32  # any int seed
