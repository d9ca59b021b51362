"""ATC as its authors run it (strategy "atc"): against the float64 loop reference of
helpers/atc_reference.py on timm models and a Hugging Face family, for each linkage, each check
shown to catch a deliberately broken variant; the clustering against the authors' own call
(scikit-learn's AgglomerativeClustering on the precomputed cosine distances) and on exact ties;
nothing reduced is the unpatched model; token counts, η, FLOPs, options; compiled whole."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch

import pullback_ext.patch as patch
from helpers.atc_reference import agglomerate as reference_agglomerate
from helpers.atc_reference import atc_reference, cosine_distances as reference_distances
from helpers.blocks import assert_zero_reduction_is_unpatched, matches_reference, small_timm, tokens_after_each_block
from helpers.broken_merges import no_proportional_attention, unweighted_averages
from helpers.host_sync import NoHostSync
from helpers.prune import images, tiny_vit
from pullback_ext.comparison.cost import count_flops
from pullback_ext.errors import PullbackError
from pullback_ext.prune.eta import eta, patch_tokens_per_block
from pullback_ext.prune.merged_tokens import MergedTokens
from pullback_ext.prune.methods import atc, merging
from pullback_ext.prune.methods.base import BackboneShape
from pullback_ext.prune.reduction_options import ReductionOptions

LINKAGES = ("average", "single", "complete")


# deliberately broken variants: each must make the reference check fail

def _with_step(monkeypatch, change):
    """ATC's ranking on a changed :class:`MergeStep`."""
    rank = atc.ATC.rank
    monkeypatch.setattr(atc.ATC, "rank", lambda self, step: rank(self, change(step)))


def _features_as_keys(monkeypatch):
    _with_step(monkeypatch, lambda step: step._replace(attended=step.attended._replace(k=step.state.x[:, None])))


def _keys_of_the_first_head(monkeypatch):
    _with_step(monkeypatch, lambda step: step._replace(attended=step.attended._replace(k=step.attended.k[:, :1])))


def _prefix_tokens_clustered(monkeypatch):
    _with_step(monkeypatch, lambda step: step._replace(state=dataclasses.replace(step.state, num_prefix=0)))


def _euclidean_distances(monkeypatch):
    def euclidean(keys):
        metric = keys.mean(dim=1)
        return torch.cdist(metric, metric).masked_fill(torch.eye(metric.shape[1], dtype=torch.bool), float("inf"))

    monkeypatch.setattr(atc, "cosine_distances", euclidean)


def _farthest_pair_first(monkeypatch):
    distances = atc.cosine_distances

    def reversed_(keys):
        d = distances(keys)
        return (2.0 - d).masked_fill(torch.isinf(d), float("inf"))

    monkeypatch.setattr(atc, "cosine_distances", reversed_)


def _count_from_the_current_tokens(monkeypatch):
    monkeypatch.setattr(atc, "cluster_count", lambda keep_rate, num_patch, stage, current, taper=1.0: max(1, int(current * keep_rate)))


def _count_rounded_up(monkeypatch):
    monkeypatch.setattr(atc, "cluster_count", lambda keep_rate, num_patch, stage, current, taper=1.0: min(current, math.ceil(num_patch * keep_rate ** stage)))


def _clusters_in_every_block(monkeypatch):
    monkeypatch.setattr(atc.ATC, "block_merges", lambda self, reduction: [1] * reduction.backbone.depth)


def _another_linkage(linkage):
    other = {"average": "single", "single": "complete", "complete": "average"}[linkage]

    def broken(monkeypatch):
        agglomerate = atc.agglomerate
        monkeypatch.setattr(atc, "agglomerate", lambda dist, count, _: agglomerate(dist, count, other))

    return broken


BROKEN = {
    "features_as_keys": _features_as_keys, "keys_of_the_first_head": _keys_of_the_first_head,
    "prefix_tokens_clustered": _prefix_tokens_clustered, "euclidean_distances": _euclidean_distances,
    "farthest_pair_first": _farthest_pair_first, "count_from_the_current_tokens": _count_from_the_current_tokens,
    "count_rounded_up": _count_rounded_up, "clusters_in_every_block": _clusters_in_every_block,
    "no_size_weights": unweighted_averages, "no_proportional_attention": no_proportional_attention,
}
CASES = [(None, linkage) for linkage in LINKAGES] + [(b, "average") for b in BROKEN] + [("another_linkage", l) for l in LINKAGES]


def _break(broken, linkage, monkeypatch):
    if broken == "another_linkage":
        _another_linkage(linkage)(monkeypatch)
    elif broken:
        BROKEN[broken](monkeypatch)


@pytest.mark.parametrize("broken,linkage", CASES)
def test_atc_matches_the_reference_and_the_check_catches_broken_variants(broken, linkage, monkeypatch):
    """16 patch tokens, keep rate 0.8 at the default blocks 1, 2, 3 of 5: 12, 10, 8 clusters
    (``int(16 · 0.8^s)``; 12, 9, 7 counted from the current tokens)."""
    model = tiny_vit(reg_tokens=1, depth=5).double()
    x = images(2).double()
    expected, expected_blocks = atc_reference(model, x, 0.8, (1, 2, 3), linkage)
    _break(broken, linkage, monkeypatch)
    patch.timm(model, strategy="atc", keep_rate=0.8, linkage=linkage)
    assert patch.config(model).atc_layers == (1, 2, 3)
    assert matches_reference(model, x, expected, expected_blocks) == (broken is None)


def _size_weighted_anyway(monkeypatch):
    monkeypatch.setattr(atc, "plain_mean", merging.size_weighted)


@pytest.mark.parametrize("broken", [None, "size_weighted_anyway"])
@pytest.mark.parametrize("linkage", LINKAGES)
def test_without_proportional_attention_later_clusters_are_plain_means(linkage, broken, monkeypatch):
    """``prop_attn=False``: the authors' model forgets the sizes after every block, so the second
    and third reductions average their current tokens unweighted."""
    model = tiny_vit(depth=5).double()
    x = images(2).double()
    expected, blocks = atc_reference(model, x, 0.6, (0, 2, 3), linkage, prop_attn=False)
    if broken:
        _size_weighted_anyway(monkeypatch)
    patch.timm(model, strategy="atc", keep_rate=0.6, linkage=linkage, atc_layers=(0, 2, 3), prop_attn=False)
    assert matches_reference(model, x, expected, blocks) == (broken is None)


LAYER_SCALE_MODELS = [("vit_small_patch14_reg4_dinov2", 56), ("deit3_small_patch16_224", 64)]


@pytest.mark.parametrize("name,size", LAYER_SCALE_MODELS)
def test_layer_scale_and_register_models(name, size):
    """keep_rate 1 is the unpatched model bit for bit; below it the reference that applies ls1 / ls2."""
    model = small_timm(name, size)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    plain = assert_zero_reduction_is_unpatched(model, x, patch.timm, strategy="atc", keep_rate=1.0, atc_layers=(0, 1, 2))
    patch.timm(model, strategy="atc", keep_rate=0.7, linkage="complete", atc_layers=(0, 1, 2))
    expected, blocks = atc_reference(model, x, 0.7, (0, 1, 2), "complete")
    assert matches_reference(model, x, expected, blocks)
    patch.unpatch(model)
    assert torch.equal(model.forward_features(x), plain)


# a Hugging Face family: the reference on timm blocks with the same weights

HF_CASES = [("dinov2", linkage, None) for linkage in LINKAGES] + [("siglip", "average", None)] + [
    ("dinov2", "average", broken) for broken in ("features_as_keys", "no_proportional_attention", "prefix_tokens_clustered")]


@pytest.mark.parametrize("family,linkage,broken", HF_CASES)
def test_a_hugging_face_family_matches_the_reference_on_timm_blocks_with_the_same_weights(family, linkage, broken, monkeypatch):
    """DINOv2 (CLS, 2 registers, LayerScale) and SigLIP (no prefix token: every token clustered):
    every layer output is the reference's, clustered tokens given back to their positions;
    keep_rate 1 is the unpatched model."""
    from helpers.hf_stand_ins import PATCHES, hidden_states, timm_stand_in, tiny

    model, x = tiny(family), images(1).double()
    plain = hidden_states(model, x)
    final, per_layer = atc_reference(timm_stand_in(model, family), plain[0], 0.7, (1, 2), linkage)
    _break(broken, linkage, monkeypatch)
    PATCHES[family](model, strategy="atc", keep_rate=0.7, linkage=linkage, atc_layers=(1, 2))
    hidden = hidden_states(model, x)
    assert torch.equal(hidden[0], plain[0]) and torch.equal(hidden[1], plain[1])  # layer 0 runs whole
    close = [torch.allclose(got, want, rtol=1e-9, atol=1e-9) for got, want in zip(hidden[1:], per_layer)]
    assert all(close + [torch.allclose(hidden[-1], final, rtol=1e-9, atol=1e-9)]) == (broken is None)
    assert not torch.allclose(hidden[-1], plain[-1], atol=1e-4)
    PATCHES[family](model, strategy="atc", keep_rate=1.0, atc_layers=(1, 2))
    assert all(torch.equal(a, b) for a, b in zip(hidden_states(model, x), plain))


# the clustering itself

def _partition(owner) -> set:
    return {frozenset(np.flatnonzero(np.asarray(owner) == label).tolist()) for label in set(np.asarray(owner).tolist())}


def _random_cases(count: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        n = int(torch.randint(3, 21, (1,), generator=g))
        yield torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64), int(torch.randint(1, n, (1,), generator=g))


@pytest.mark.parametrize("linkage", LINKAGES)
def test_the_clustering_is_the_authors_scikit_learn_call(linkage):
    """The partitions of :func:`atc.agglomerate` and of the reference equal those of
    ``AgglomerativeClustering(n_clusters, metric="precomputed", linkage)`` on ``1 - cos`` of the
    head-mean keys (``atc.py:261-275`` of the authors' code); another linkage does not."""
    from sklearn.cluster import AgglomerativeClustering

    differs = 0
    for keys, count in _random_cases(40):
        owner = atc.agglomerate(atc.cosine_distances(keys), count, linkage)
        other = atc.agglomerate(atc.cosine_distances(keys), count, "single" if linkage != "single" else "complete")
        for image in range(keys.shape[0]):
            dist = reference_distances(keys[image], list(range(keys.shape[2])))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "the full tree is built" with n_clusters
                labels = AgglomerativeClustering(n_clusters=count, metric="precomputed", linkage=linkage).fit(np.array(dist)).labels_
            theirs = _partition(labels)
            assert _partition(owner[image].tolist()) == theirs
            assert {frozenset(c) for c in reference_agglomerate(dist, count, linkage)} == theirs
            differs += _partition(other[image].tolist()) != theirs
    assert differs > 0


@pytest.mark.parametrize("linkage", LINKAGES)
def test_ties_go_to_the_first_pair_by_smallest_members_as_in_the_reference(linkage):
    """Integer distances (exact sums, many ties): the same clusters, named by their smallest member."""
    g = torch.Generator().manual_seed(5)
    for n in (2, 5, 9, 14):
        upper = torch.triu(torch.randint(0, 3, (4, n, n), generator=g).double(), diagonal=1)
        dist = (upper + upper.transpose(1, 2)).masked_fill(torch.eye(n, dtype=torch.bool), float("inf"))
        for count in range(1, n + 1):
            owner = atc.agglomerate(dist, count, linkage)
            for image in range(4):
                rows = [[0.0 if a == b else float(dist[image, a, b]) for b in range(n)] for a in range(n)]
                want = [0] * n
                for cluster in reference_agglomerate(rows, count, linkage):
                    for m in cluster:
                        want[m] = cluster[0]
                assert owner[image].tolist() == want, (n, count, image)
    equal = torch.ones(1, 4, 4, dtype=torch.float64).masked_fill(torch.eye(4, dtype=torch.bool), float("inf"))
    assert atc.agglomerate(equal, 2, linkage).tolist() == [[0, 0, 0, 3]]  # (0, 1), then ({0, 1}, 2)


def test_a_clustering_is_a_matching_onto_each_clusters_first_member():
    owner = torch.tensor([[0, 0, 2, 0, 2, 5]])
    order, src, dst = atc.cluster_matching(owner, 3, num_prefix=1)
    assert order.tolist() == [list(range(7))] and src.tolist() == [[2, 4, 5]] and dst.tolist() == [[1, 1, 3]]
    state = merging.apply_matching(MergedTokens(torch.arange(7.0, dtype=torch.float64)[None, :, None], 1), atc.cluster_matching(owner, 3, 1))
    assert state.x[0, :, 0].tolist() == pytest.approx([0.0, (1 + 2 + 4) / 3, (3 + 5) / 2, 6.0], abs=1e-15)  # [prefix, {0,1,3}, {2,4}, {5}]
    assert state.sizes.tolist() == [[1.0, 3.0, 2.0, 1.0]] and state.owner.tolist() == [[0, 1, 1, 2, 1, 2, 3]]
    assert state.positions.tolist() == [[0, 1, 3, 6]]  # a cluster keeps its first member's (rotary) position


# counts, η, FLOPs

def test_cluster_counts_are_the_authors_truncated_geometric_targets():
    assert [atc.cluster_count(0.9, 196, s, 196) for s in (1, 2, 3)] == [176, 158, 142]  # int(196 · 0.9^s)
    assert [atc.cluster_count(0.25, 196, s, 196) for s in (1, 2, 3)] == [49, 12, 3]
    assert atc.cluster_count(0.1, 16, 3, 2) == 1  # int(0.016) = 0: one cluster (the authors skip the block)
    assert atc.cluster_count(0.9, 196, 1, 100) == 100  # never more than the current tokens


@pytest.mark.parametrize("reg_tokens,keep_rate,layers", [(0, 0.8, None), (1, 0.5, None), (2, 0.3, (0, 1)), (0, 0.05, (0, 2, 4))])
def test_token_counts_and_eta_follow_the_keep_rate(reg_tokens, keep_rate, layers):
    model = tiny_vit(reg_tokens=reg_tokens, depth=5)
    patch.timm(model, strategy="atc", keep_rate=keep_rate, atc_layers=layers)
    options, p = patch.config(model), 1 + reg_tokens
    counts = patch_tokens_per_block(options, model)
    stages = options.atc_layers
    n = 16
    want = []
    for i in range(5):
        if i in stages:
            n = max(1, min(n, int(16 * keep_rate ** (stages.index(i) + 1))))
        want.append(n)
    assert counts == want
    assert [c - p for c in tokens_after_each_block(model, images(2))] == counts
    assert eta(options, model) == 1 - counts[-1] / 16
    assert eta(ReductionOptions(strategy="atc", keep_rate=0.8), tiny_vit(depth=5)) == 0.5  # 16 -> 12 -> 10 -> 8


def test_flops_of_the_patched_forward_drop_as_the_keep_rate_falls():
    model = tiny_vit(reg_tokens=1, depth=5)
    x = images(1)
    plain = count_flops(model.forward_features, x)
    flops = []
    for keep_rate in (1.0, 0.9, 0.7, 0.5, 0.3):
        patch.timm(model, strategy="atc", keep_rate=keep_rate)
        flops.append(count_flops(model.forward_features, x))
    assert flops[0] == plain
    assert all(later < earlier for earlier, later in zip(flops, flops[1:]))


def test_batch_rows_are_independent_and_dense_readers_get_each_cluster_back():
    model = tiny_vit(reg_tokens=1, depth=5).double()
    x = images(3).double()
    patch.timm(model, strategy="atc", keep_rate=0.8, linkage="single")
    batched = model.forward_features(x)
    single = torch.cat([model.forward_features(x[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(batched, single, rtol=1e-12, atol=1e-12)
    grid = model.forward_intermediates(x, indices=[3], intermediates_only=True)[0]
    assert grid.shape == (3, 32, 4, 4)
    assert all(len(torch.unique(grid[i].flatten(1).T, dim=0)) == 8 for i in range(3))  # 8 clusters after block 3


# options

@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(), r"needs keep_rate= \(fraction of patch tokens kept per reduction block\)"),
        (dict(keep_rate=0.0), r"keep_rate must be None or a float in \(0, 1\]"),
        (dict(keep_rate=1.5), r"keep_rate must be None or a float in \(0, 1\]"),
        (dict(keep_rate="0.5"), r"keep_rate must be None or a float in \(0, 1\]"),
        (dict(keep_rate=True), r"keep_rate must be None or a float in \(0, 1\]"),
        (dict(keep_rate=0.5, linkage="ward"), "linkage must be one of average, single, complete; got 'ward'"),
        (dict(keep_rate=0.5, linkage=None), "linkage must be one of average, single, complete; got None"),
        (dict(keep_rate=0.5, atc_layers=(2, 1)), "atc_layers must be strictly increasing"),
        (dict(keep_rate=0.5, atc_layers=(1.5,)), r"atc_layers must be block indices \(ints\)"),
        (dict(keep_rate=0.5, atc_layers=(1, 4)), r"atc_layers must lie in \[0, 3\] for this 4-block model"),
        (dict(keep_rate=0.5), "atc_layers: ATC's blocks 3, 6, 9 of 12 do not scale to this 4-block model"),
        (dict(keep_rate=0.5, r=2), "r is an option of strategy .*'tome'.*; got strategy 'atc'"),
        (dict(keep_rate=0.5, ratio=0.5), "strategy 'atc' does not take ratio .* it takes keep_rate, linkage, atc_layers and prop_attn"),
        (dict(keep_rate=0.5, atc_layers=(1, 2), mode="prune"), "has no prune mode"),
    ],
)
def test_invalid_atc_options_name_the_field(kwargs, match):
    with pytest.raises(PullbackError, match=match):
        patch.timm(tiny_vit(), strategy="atc", **kwargs)


def test_atc_fields_need_atc_and_keep_rate_names_both_methods():
    with pytest.raises(PullbackError, match="linkage is an option of strategy 'atc'; got strategy 'tome'"):
        ReductionOptions(strategy="tome", r=2, linkage="single")
    with pytest.raises(PullbackError, match="atc_layers is an option of strategy 'atc'; got strategy 'evit'"):
        ReductionOptions(strategy="evit", keep_rate=0.5, atc_layers=(1,))
    with pytest.raises(PullbackError, match="keep_rate is an option of strategy 'evit', 'atc' or 'importance_cluster'; got strategy 'tome'"):
        ReductionOptions(strategy="tome", r=2, keep_rate=0.5)


def test_options_round_trip_resolve_to_the_authors_defaults_and_rows_name_the_rules():
    from helpers.prune import tiny_dinov2

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options = ReductionOptions(strategy="atc", keep_rate=0.7, linkage="complete", atc_layers=[1, 2], prop_attn=False)
    assert options.atc_layers == (1, 2) and ReductionOptions.from_dict(options.to_dict()) == options
    resolved = patch.config(patch.timm(tiny_vit(depth=12), strategy="atc", keep_rate=0.9))
    assert (resolved.atc_layers, resolved.linkage, resolved.prop_attn, resolved.mode) == ((3, 6, 9), "average", True, "merge")
    assert patch.config(patch.timm(tiny_vit(depth=8), strategy="atc", keep_rate=0.9)).atc_layers == (2, 4, 5)
    assert patch.config(patch.hf_dinov2(tiny_dinov2(), strategy="atc", keep_rate=0.5, atc_layers=(1,))).keep_rate == 0.5
    reduction = ReductionOptions(strategy="atc", keep_rate=0.9).resolve(BackboneShape(depth=12, num_prefix=1, has_cls=True))
    row = atc.METHODS[0].describe(reduction)
    assert "average linkage" in row["selection"] and "fine-tune" in row["selection"] and "size-weighted" in row["averaging"]
    single = ReductionOptions(strategy="atc", keep_rate=0.9, linkage="single", prop_attn=False).resolve(reduction.backbone)
    assert "single linkage" in atc.METHODS[0].describe(single)["selection"]
    assert "unweighted" in atc.METHODS[0].describe(single)["averaging"]


# compiled whole, no host read

def _patched_forward():
    model = patch.timm(tiny_vit(reg_tokens=1, depth=3), strategy="atc", keep_rate=0.7, atc_layers=(0, 1))
    return model.forward_features


def test_fullgraph_compile_equals_eager_and_the_eager_forward_reads_nothing_on_the_host():
    """The clustering loop has a step count fixed by the shapes (16 -> 11 -> 7 tokens here) and
    reads no tensor value, so it traces into one graph (unrolled)."""
    torch._dynamo.reset()
    forward, x = _patched_forward(), images()
    expected = forward(x)
    with NoHostSync():
        forward(x)
    with torch._dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False):
        compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, expected, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
