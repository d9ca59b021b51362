"""importance_cluster (ATC's schedule, importance_tome's bound as the cost between clusters): against
the float64 loop reference of helpers/importance_cluster_reference.py with and without a head, each
check shown to catch a deliberately broken variant; the clustering against scipy's Ward linkage
(equal sizes and energies) and the loop reference (any); token counts, options, rows; compiled whole."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import pullback_ext.patch as patch
from helpers.blocks import matches_reference, tokens_after_each_block
from helpers.host_sync import NoHostSync
from helpers.importance_cluster_reference import agglomerate as reference_agglomerate
from helpers.importance_cluster_reference import importance_cluster_reference
from helpers.prune import images, tiny_vit
from pullback_ext.errors import PullbackError
from pullback_ext.prune.eta import patch_tokens_per_block
from pullback_ext.prune.methods import atc, importance_cluster as ic
from pullback_ext.prune.methods.base import BackboneShape
from pullback_ext.prune.reduction_options import ReductionOptions


class NormHead(torch.nn.Module):
    """A fixed importance head: the norm of a linear map of each token (positive, varied)."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.map = torch.nn.Linear(dim, 4, dtype=torch.float64)
        with torch.no_grad():
            self.map.weight.copy_(torch.randn(4, dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64))

    def forward(self, features):
        return self.map(features).norm(dim=-1)


# deliberately broken variants: each must make the reference check fail

def _with_step(monkeypatch, change):
    rank = ic.ImportanceCluster.rank
    monkeypatch.setattr(ic.ImportanceCluster, "rank", lambda self, step: rank(self, change(step)))


def _prefix_tokens_clustered(monkeypatch):
    _with_step(monkeypatch, lambda step: step._replace(state=dataclasses.replace(step.state, num_prefix=0)))


def _atc_average_linkage(monkeypatch):
    monkeypatch.setattr(ic, "agglomerate_bound", lambda unit, sizes, energy, count: atc.agglomerate(
        atc.cosine_distances(unit[:, None]), count, "average"))


def _energies_ignored(monkeypatch):
    agglomerate = ic.agglomerate_bound
    monkeypatch.setattr(ic, "agglomerate_bound", lambda unit, sizes, energy, count: agglomerate(unit, sizes, sizes, count))


def _sizes_ignored(monkeypatch):
    agglomerate = ic.agglomerate_bound
    monkeypatch.setattr(ic, "agglomerate_bound",
                        lambda unit, sizes, energy, count: agglomerate(unit, torch.ones_like(sizes), energy, count))


def _no_shrink(monkeypatch):
    shrunk = ic.shrunk
    monkeypatch.setattr(ic, "shrunk", lambda energy, sizes, p, shrink: shrunk(energy, sizes, p, 0.0))


def _count_from_the_current_tokens(monkeypatch):
    monkeypatch.setattr(atc, "cluster_count", lambda keep_rate, num_patch, stage, current, taper=1.0: max(1, int(current * keep_rate)))


BROKEN = {"prefix_tokens_clustered": _prefix_tokens_clustered, "atc_average_linkage": _atc_average_linkage,
          "energies_ignored": _energies_ignored, "sizes_ignored": _sizes_ignored,
          "no_shrink": _no_shrink, "count_from_the_current_tokens": _count_from_the_current_tokens}
CASES = [(None, False), (None, True)] + [(b, b in ("energies_ignored", "no_shrink")) for b in BROKEN]


@pytest.mark.parametrize("broken,with_head", CASES)
def test_importance_cluster_matches_the_reference_and_the_check_catches_broken_variants(broken, with_head, monkeypatch):
    """16 patch tokens and a register, keep rate 0.7 at blocks 1, 2, 3 of 5 (11, 7, 5 clusters);
    with a head scoring block 0's output, shrink 0.3."""
    model = tiny_vit(reg_tokens=1, depth=5).double()
    x = images(2).double()
    head = NormHead() if with_head else None
    expected, blocks = importance_cluster_reference(model, x, 0.7, (1, 2, 3), head, score_layer=0, shrink=0.3)
    if broken:
        BROKEN[broken](monkeypatch)
    patch.timm(model, strategy="importance_cluster", keep_rate=0.7, cluster_layers=(1, 2, 3), head=head,
               **(dict(score_layer=0, shrink=0.3) if with_head else {}))
    assert matches_reference(model, x, expected, blocks) == (broken is None)


@pytest.mark.parametrize("broken", [None, "count_from_the_current_tokens"])
def test_a_taper_keeps_more_tokens_in_the_later_blocks_as_the_reference_counts(broken, monkeypatch):
    """taper 0.5 at blocks 1-4 of 6, keep rate 0.5, 16 patch tokens: the reference's counts 8, 6, 4, 4
    against ATC's 8, 4, 2, 1; the forward, the counts the cost model reads and the reference agree."""
    model = tiny_vit(reg_tokens=1, depth=6).double()
    x = images(2).double()
    expected, blocks = importance_cluster_reference(model, x, 0.5, (1, 2, 3, 4), taper=0.5)
    if broken:
        BROKEN[broken](monkeypatch)
    patch.timm(model, strategy="importance_cluster", keep_rate=0.5, cluster_layers=(1, 2, 3, 4), taper=0.5)
    assert matches_reference(model, x, expected, blocks) == (broken is None)
    if broken is None:
        counts = patch_tokens_per_block(patch.config(model), model)
        assert counts == [16, 8, 6, 4, 4, 4]
        assert [c - 2 for c in tokens_after_each_block(model, x)] == counts
        resolved = ReductionOptions(strategy="importance_cluster", keep_rate=0.5, cluster_layers=(1, 2, 3, 4),
                                    taper=0.5).resolve(BackboneShape(depth=6, num_prefix=2, has_cls=True))
        assert "the s-th clustering block keeping int(N0 · keep_rate^(s^0.5))" in ic.METHODS[0].describe(resolved)["selection"]


def test_a_hugging_face_family_matches_the_reference_on_timm_blocks_with_the_same_weights():
    """DINOv2 (CLS, 2 registers, LayerScale): every layer output is the reference's."""
    from helpers.hf_stand_ins import PATCHES, hidden_states, timm_stand_in, tiny

    model, x = tiny("dinov2"), images(1).double()
    plain = hidden_states(model, x)
    final, per_layer = importance_cluster_reference(timm_stand_in(model, "dinov2"), plain[0], 0.7, (1, 2))
    PATCHES["dinov2"](model, strategy="importance_cluster", keep_rate=0.7, cluster_layers=(1, 2))
    hidden = hidden_states(model, x)
    assert all(torch.allclose(got, want, rtol=1e-9, atol=1e-9) for got, want in zip(hidden[1:], per_layer))
    assert torch.allclose(hidden[-1], final, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(hidden[-1], plain[-1], atol=1e-4)


# the clustering itself

def _partition(owner) -> set:
    return {frozenset(np.flatnonzero(np.asarray(owner) == label).tolist()) for label in set(np.asarray(owner).tolist())}


def _unit_cases(count: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        n = int(torch.randint(3, 18, (1,), generator=g))
        unit = torch.nn.functional.normalize(torch.randn(2, n, 4, generator=g, dtype=torch.float64), dim=-1)
        yield unit, int(torch.randint(1, n, (1,), generator=g)), g


def test_with_equal_weights_the_clustering_is_scipys_ward_linkage():
    """Sizes and energies all 1: the cost is Ward's criterion, so the partition is scipy's Ward
    linkage cut at the count; the average linkage of ATC on the same keys differs somewhere."""
    from scipy.cluster.hierarchy import cut_tree, linkage

    differs = 0
    for unit, count, _ in _unit_cases(40):
        ones = torch.ones(unit.shape[:2], dtype=torch.float64)
        owner = ic.agglomerate_bound(unit, ones, ones, count)
        average = atc.agglomerate(atc.cosine_distances(unit[:, None]), count, "average")
        for image in range(unit.shape[0]):
            labels = cut_tree(linkage(unit[image].numpy(), "ward"), n_clusters=count)[:, 0]
            assert _partition(owner[image].tolist()) == _partition(labels)
            differs += _partition(average[image].tolist()) != _partition(labels)
    assert differs > 0


def test_with_any_sizes_and_energies_the_clustering_is_the_loop_reference():
    """... and not the same loop with unweighted centres (plain means of the members' keys)."""
    differs = 0
    for unit, count, g in _unit_cases(40, seed=1):
        sizes = torch.randint(1, 5, unit.shape[:2], generator=g).double()
        energy = sizes * torch.rand(unit.shape[:2], generator=g, dtype=torch.float64) * 3
        owner = ic.agglomerate_bound(unit, sizes, energy, count)
        for image in range(unit.shape[0]):
            want = [0] * unit.shape[1]
            for cluster in reference_agglomerate(list(unit[image]), sizes[image].tolist(), energy[image].tolist(), count):
                for m in cluster:
                    want[m] = cluster[0]
            assert owner[image].tolist() == want
            plain = reference_agglomerate(list(unit[image]), sizes[image].tolist(), energy[image].tolist(), count, weighted=False)
            differs += _partition(want) != {frozenset(c) for c in plain}
    assert differs > 0


def test_the_distances_are_symmetric_to_the_last_bit_and_equal_keys_tie_to_the_first_pair():
    g = torch.Generator().manual_seed(2)
    unit = torch.nn.functional.normalize(torch.randn(2, 9, 3, generator=g), dim=-1)
    squared = ic.squared_key_distances(unit)
    assert torch.equal(squared, squared.transpose(1, 2))
    assert torch.allclose(squared, torch.cdist(unit, unit).square(), atol=1e-5)
    same = torch.ones(1, 4, 2, dtype=torch.float64) / 2 ** 0.5
    ones = torch.ones(1, 4, dtype=torch.float64)
    assert ic.agglomerate_bound(same, ones, ones, 2).tolist() == [[0, 0, 0, 3]]  # (0, 1), then ({0, 1}, 2)


# counts, rows, options

def test_token_counts_are_atcs_and_the_patched_forward_has_them():
    model = tiny_vit(reg_tokens=1, depth=5)
    patch.timm(model, strategy="importance_cluster", keep_rate=0.6)
    ours = patch_tokens_per_block(patch.config(model), model)
    assert [c - 2 for c in tokens_after_each_block(model, images(2))] == ours
    patch.timm(model, strategy="atc", keep_rate=0.6)
    assert patch_tokens_per_block(patch.config(model), model) == ours


def test_defaults_resolve_to_atcs_blocks_and_rows_name_the_rule():
    resolved = patch.config(patch.timm(tiny_vit(depth=8), strategy="importance_cluster", keep_rate=0.9))
    assert (resolved.cluster_layers, resolved.prop_attn, resolved.mode, resolved.score_layer) == ((2, 4, 5), True, "merge", None)
    inner = patch.config(patch.timm(tiny_vit(depth=8), strategy="importance_cluster", keep_rate=0.9, cluster_layers="inner"))
    assert inner.cluster_layers == (1, 2, 3, 4, 5, 6)  # without a head: every block after block 0 but the last
    headed = patch.config(patch.timm(tiny_vit(depth=8), strategy="importance_cluster", keep_rate=0.9, cluster_layers="inner",
                                     head=NormHead(), score_layer=2))
    assert headed.cluster_layers == (3, 4, 5, 6)
    options = ReductionOptions(strategy="importance_cluster", keep_rate=0.7, cluster_layers=[1, 2])
    assert options.cluster_layers == (1, 2) and ReductionOptions.from_dict(options.to_dict()) == options
    method = ic.METHODS[0]
    assert method.ours
    shape = BackboneShape(depth=8, num_prefix=1, has_cls=True)
    row = method.describe(ReductionOptions(strategy="importance_cluster", keep_rate=0.9).resolve(shape))
    assert "Ward" in row["selection"] and "2, 4, 5" in row["selection"] and "proportional attention" in row["averaging"]
    headed = ReductionOptions(strategy="importance_cluster", keep_rate=0.9, head=NormHead(), score_layer=1).resolve(shape)
    assert "head on block 1" in method.describe(headed)["selection"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(), r"needs keep_rate= \(fraction of patch tokens kept per reduction block\)"),
        (dict(keep_rate=1.5), r"keep_rate must be None or a float in \(0, 1\]"),
        (dict(keep_rate=0.5, cluster_layers=(2, 1)), "cluster_layers must be strictly increasing"),
        (dict(keep_rate=0.5, cluster_layers="all"), "cluster_layers must be 'atc' .*, 'inner' .* or block indices; got 'all'"),
        (dict(keep_rate=0.5, cluster_layers=(1, 4)), r"cluster_layers must lie in \[0, 3\] for this 4-block model"),
        (dict(keep_rate=0.5), "cluster_layers: ATC's blocks 3, 6, 9 of 12 do not scale to this 4-block model"),
        (dict(keep_rate=0.5, cluster_layers=(1, 2), head=NormHead(), score_layer=1),
         "score_layer: the head scores block 1 .score_layer., which must come before the first clustering block 1"),
        (dict(keep_rate=0.5, cluster_layers=(1, 2), head=[NormHead()]), "takes head= an importance head"),
        (dict(keep_rate=0.5, cluster_layers=(1, 2), shrink=2.0), r"shrink must be a number in \[0, 1\]"),
        (dict(keep_rate=0.5, cluster_layers=(1, 2), taper=0.0), r"taper must be a number in \(0, 1\] .*got 0.0"),
        (dict(keep_rate=0.5, cluster_layers=(1, 2), taper=float("nan")), r"taper must be a number in \(0, 1\]"),
        (dict(keep_rate=0.5, cluster_layers=(1, 2), taper="0.7"), r"taper must be a number in \(0, 1\]"),
        (dict(keep_rate=0.5, cluster_layers=(1, 2), r=2), "r is an option of strategy"),
        (dict(keep_rate=0.5, cluster_layers=(1, 2), linkage="single"), "linkage is an option of strategy 'atc'"),
    ],
)
def test_invalid_options_name_the_field(kwargs, match):
    with pytest.raises(PullbackError, match=match):
        patch.timm(tiny_vit(), strategy="importance_cluster", **kwargs)


def test_inner_blocks_need_three_blocks():
    with pytest.raises(PullbackError, match="cluster_layers='inner' names every block after block 0 but the last, and this 2-block"):
        patch.timm(tiny_vit(depth=2), strategy="importance_cluster", keep_rate=0.5, cluster_layers="inner")


def test_fullgraph_compile_equals_eager_and_the_eager_forward_reads_nothing_on_the_host():
    torch._dynamo.reset()
    model = patch.timm(tiny_vit(reg_tokens=1, depth=3), strategy="importance_cluster", keep_rate=0.7,
                       cluster_layers=(1, 2), head=NormHead().float(), score_layer=0)
    forward, x = model.forward_features, images()
    expected = forward(x)
    with NoHostSync():
        forward(x)
    with torch._dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False):
        compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, expected, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
