"""The greedy agglomeration op (``ops.agglomerate``, ATC's and importance_cluster's clustering).

Oracles: the loop of tensor ops it replaced (``reference.agglomerate``, which the compiled kernels
must match decision for decision: identical owners, in float32 as in float64, on continuous, tied
and non-finite distances), and scipy's hierarchical clustering for the reference itself (average,
single, complete linkage on the distances; Ward's method for the bound with unit sizes and energies).
The methods' own tests (test_atc.py, test_importance_cluster.py) check the op through the methods
against scikit-learn and float64 loops of the authors' rules.
"""

from __future__ import annotations

import pytest
import torch

from helpers.ops import DEVICES
from pullback_ext import ops, reference
from pullback_ext.bench.dispatch import count_aten_ops
from pullback_ext.errors import PullbackError

LINKAGES = ("average", "single", "complete", "bound")


def _symmetric(values: torch.Tensor, diagonal: float) -> torch.Tensor:
    upper = torch.triu(values, diagonal=1)
    eye = torch.eye(values.shape[-1], dtype=torch.bool)
    return (upper + upper.transpose(1, 2)).masked_fill(eye, diagonal)


def _case(kind: str, linkage: str, b: int, n: int, g: torch.Generator, dtype):
    """``(dist, sizes, energy)`` for ``linkage``: distances continuous, tied (three values) or with
    NaN, inf and zeros among them; the bound's sizes small integers, energies a multiple of them."""
    if kind == "continuous":
        values = torch.rand(b, n, n, generator=g, dtype=torch.float64)
    elif kind == "ties":
        values = torch.randint(0, 3, (b, n, n), generator=g).double()
    else:
        special = torch.tensor([float("nan"), float("inf"), 0.0, 0.5, 1.0], dtype=torch.float64)
        values = special[torch.randint(0, len(special), (b, n, n), generator=g)]
    if linkage != "bound":
        return _symmetric(values, float("inf")).to(dtype), None, None
    sizes = torch.randint(1, 4, (b, n), generator=g).double()
    energy = sizes * torch.rand(b, n, generator=g, dtype=torch.float64) * 2
    return tuple(t.to(dtype) for t in (_symmetric(values, 0.0), sizes, energy))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["continuous", "ties", "special"])
@pytest.mark.parametrize("linkage", LINKAGES)
def test_the_kernels_take_the_references_decisions(device, dtype, kind, linkage):
    g = torch.Generator().manual_seed(LINKAGES.index(linkage) + 7 * len(kind))
    for seed in range(8):
        n, b = (1, 2, 3, 6, 11, 24, 40, 57)[seed], 1 + seed % 3
        dist, sizes, energy = (t if t is None else t.to(device) for t in _case(kind, linkage, b, n, g, dtype))
        for count in sorted({min(1, n), n // 3 or 1, n // 2 or 1, n - 1 or 1, n}):
            got = ops.agglomerate(dist, sizes, energy, count=count, linkage=linkage, check_values=False)
            want = reference.agglomerate(dist, sizes, energy, count, linkage)
            assert got.dtype == torch.int64 and got.shape == (b, n)
            assert torch.equal(got.cpu(), want.cpu()), (kind, n, count)


def _partition(labels) -> set:
    groups = {}
    for t, label in enumerate(labels):
        groups.setdefault(int(label), set()).add(t)
    return {frozenset(c) for c in groups.values()}


@pytest.mark.parametrize("linkage", ["average", "single", "complete", "ward"])
def test_the_reference_is_scipys_hierarchical_clustering(linkage):
    """Continuous distances (no ties): the partition of the reference loop cut at ``count`` clusters
    is scipy's; Ward's method is the bound with unit sizes and energies on squared distances."""
    from scipy.cluster.hierarchy import cut_tree, linkage as scipy_linkage
    from scipy.spatial.distance import squareform

    g = torch.Generator().manual_seed(3)
    for _ in range(15):
        n = int(torch.randint(3, 20, (1,), generator=g))
        points = torch.randn(1, n, 4, generator=g, dtype=torch.float64)
        euclid = torch.cdist(points, points)
        count = int(torch.randint(1, n, (1,), generator=g))
        if linkage == "ward":
            ones = torch.ones(1, n, dtype=torch.float64)
            owner = reference.agglomerate(euclid.square(), ones, ones, count, "bound")
            tree = scipy_linkage(points[0].numpy(), "ward")
        else:
            dist = euclid.masked_fill(torch.eye(n, dtype=torch.bool), float("inf"))
            owner = reference.agglomerate(dist, None, None, count, linkage)
            tree = scipy_linkage(squareform(euclid[0].numpy(), checks=False), linkage)
        assert _partition(owner[0].tolist()) == _partition(cut_tree(tree, n_clusters=count)[:, 0])


def test_a_cluster_is_named_by_its_smallest_member_and_merges_nest():
    dist = _symmetric(torch.tensor([[[0, 1, 5, 6], [0, 0, 4, 7], [0, 0, 0, 2], [0, 0, 0, 0]]], dtype=torch.float64),
                      float("inf"))
    assert ops.agglomerate(dist, count=3, linkage="single").tolist() == [[0, 0, 2, 3]]
    assert ops.agglomerate(dist, count=2, linkage="single").tolist() == [[0, 0, 2, 2]]
    assert ops.agglomerate(dist, count=1, linkage="single").tolist() == [[0, 0, 0, 0]]
    assert ops.agglomerate(dist, count=4, linkage="single").tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("device", DEVICES)
def test_one_call_is_a_handful_of_dispatches_whatever_the_merges(device):
    """The compiled op is one dispatch (plus its checks' metadata), where the reference is a dozen
    per merge: the point of the kernel for a batch-1 forward."""
    g = torch.Generator().manual_seed(0)
    dist = _case("continuous", "average", 1, 60, g, torch.float32)[0].to(device)
    few = count_aten_ops(lambda: ops.agglomerate(dist, count=58, check_values=False))
    many = count_aten_ops(lambda: ops.agglomerate(dist, count=2, check_values=False))
    looped = count_aten_ops(lambda: reference.agglomerate(dist, None, None, 2, "average"))
    assert few == many <= 3 and looped > 100 * many


def test_opcheck_and_compile_without_a_graph_break():
    g = torch.Generator().manual_seed(1)
    for linkage in LINKAGES:
        dist, sizes, energy = _case("continuous", linkage, 2, 9, g, torch.float32)
        torch.library.opcheck(torch.ops.pullback_ext.agglomerate.default, (dist, sizes, energy, 4, linkage))
    compiled = torch.compile(lambda d, s, e: ops.agglomerate(d, s, e, count=4, linkage="bound", check_values=False),
                             fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(dist, sizes, energy), reference.agglomerate(dist, sizes, energy, 4, "bound"))


def test_bad_arguments_are_named():
    dist = _symmetric(torch.rand(2, 5, 5, dtype=torch.float64), float("inf"))
    sizes = torch.ones(2, 5, dtype=torch.float64)
    cases = [
        (lambda: ops.agglomerate(dist[:, :4], count=2), PullbackError, r"dist must have shape \[B, n, n\]"),
        (lambda: ops.agglomerate(dist[0], count=2), PullbackError, "dist must have 3 dimensions"),
        (lambda: ops.agglomerate(dist.long(), count=2), TypeError, "dist must be a floating-point tensor"),
        (lambda: ops.agglomerate(dist, count=0), PullbackError, "count must be >= 1"),
        (lambda: ops.agglomerate(dist, count=6), PullbackError, "count must be <= n = 5"),
        (lambda: ops.agglomerate(dist, count=2.0), TypeError, "integer"),
        (lambda: ops.agglomerate(dist, count=2, linkage="ward"), PullbackError, "linkage must be one of average"),
        (lambda: ops.agglomerate(dist, count=2, linkage="bound"), PullbackError, "linkage 'bound' needs sizes"),
        (lambda: ops.agglomerate(dist, sizes, count=2), PullbackError, "sizes is read by linkage 'bound' only"),
        (lambda: ops.agglomerate(dist, sizes, sizes[:, :4], count=2, linkage="bound"), PullbackError,
         r"energy must have shape \[B, n\]"),
        (lambda: ops.agglomerate(dist, sizes.float(), sizes, count=2, linkage="bound"), TypeError,
         "sizes must have the dtype of dist"),
        (lambda: ops.agglomerate(dist.transpose(0, 1).contiguous().transpose(0, 1) + torch.triu(torch.ones(5, 5), 1),
                                 count=2), PullbackError, r"dist must be symmetric: dist\[0, 0, 1\]"),
        (lambda: ops.agglomerate(dist, -sizes, sizes, count=2, linkage="bound"), PullbackError, "sizes must be > 0"),
        (lambda: ops.agglomerate(dist, sizes, -sizes, count=2, linkage="bound"), PullbackError, "energy must be >= 0"),
        (lambda: ops.agglomerate(dist, count=2, check_finite=True), PullbackError, "dist contains 10 NaN or infinite"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def test_the_kernel_is_memory_safe_on_unchecked_arguments():
    """A direct op call with a count of 0, an empty batch or NaN everywhere returns owners in range
    (unspecified), and inconsistent metadata is refused by the kernel's invariants."""
    nan = torch.full((2, 6, 6), float("nan"))
    for linkage in ("average", "single"):
        owner = torch.ops.pullback_ext.agglomerate(nan, None, None, 0, linkage)
        assert owner.shape == (2, 6) and bool(((owner >= 0) & (owner < 6)).all())
    assert torch.ops.pullback_ext.agglomerate(torch.zeros(0, 3, 3), None, None, 1, "single").shape == (0, 3)
    with pytest.raises(RuntimeError, match="internal invariant violated"):
        torch.ops.pullback_ext.agglomerate(nan, None, None, 2, "bound")
    with pytest.raises(RuntimeError, match="internal invariant violated"):
        torch.ops.pullback_ext.agglomerate(nan[:, :5], None, None, 2, "single")
