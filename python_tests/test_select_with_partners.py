"""The partner-sparing selection of merge sources (``prune.matching.select_with_partners``, the op
``ops.select_with_partners``) selects exactly what the loop of tensor ops it replaced selected.

Oracles (``helpers.partner_selection``): that loop as it was, and the rule on Python lists. Inputs:
random costs (continuous, heavily tied, NaN/inf/±0) and partner arrays of every shape the greedy
can meet (random, nearest-neighbour-like without self, mutual pairs, chains running with and
against the cost order, self-partners, one hub everybody points at), batch > 1, count from 0 to n.
"""

from __future__ import annotations

import pytest
import torch

from helpers.partner_selection import greedy_per_image, select_with_partners_loop
from pullback_ext import ops, reference
from pullback_ext.bench.dispatch import count_aten_ops
from pullback_ext.errors import PullbackError
from pullback_ext.prune import matching

PARTNERS = ("random", "no_self", "mutual", "chain_with_cost", "chain_against_cost", "self", "hub")


def _costs(kind: str, b: int, n: int, g: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    if kind == "continuous":
        return torch.rand(b, n, generator=g, dtype=dtype)
    if kind == "ties":
        return torch.randint(0, 3, (b, n), generator=g).to(dtype)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0], dtype=dtype)
    return special[torch.randint(0, len(special), (b, n), generator=g)]


def _partners(kind: str, cost: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Patch-relative partners ``[B, n]`` of the kind named."""
    b, n = cost.shape
    t = torch.arange(n).expand(b, n)
    if kind == "random":
        return torch.randint(0, n, (b, n), generator=g)
    if kind == "no_self":  # what merge_drift gives: never the token itself
        return (t + torch.randint(1, max(n, 2), (b, n), generator=g)) % n if n > 1 else t.clone()
    if kind == "mutual":  # pairs pointing at each other in a random pairing (odd n: one self-partner)
        perm = torch.stack([torch.randperm(n, generator=g) for _ in range(b)])
        even, mate = n - n % 2, perm.clone()
        mate[:, 0:even:2], mate[:, 1:even:2] = perm[:, 1:even:2], perm[:, 0:even:2]
        return torch.empty_like(perm).scatter(1, perm, mate)
    if kind in ("chain_with_cost", "chain_against_cost"):
        # each token points at the next dearer one (every step of the greedy depends on the one
        # before), or at the next cheaper one; the ends close the cycle
        order = torch.argsort(cost, dim=1, stable=True)
        nxt = order.roll(-1 if kind == "chain_with_cost" else 1, dims=1)
        return torch.empty_like(order).scatter(1, order, nxt)
    if kind == "self":
        partner = torch.randint(0, n, (b, n), generator=g)
        return torch.where(torch.rand(b, n, generator=g) < 0.5, t, partner)
    return torch.randint(0, n, (b, 1), generator=g).expand(b, n).clone()  # hub


def _check(cost: torch.Tensor, partner: torch.Tensor, count: int, num_prefix: int) -> None:
    nearest = partner + num_prefix
    got = matching.select_with_partners(cost, nearest, count, num_prefix)
    expected = select_with_partners_loop(cost, nearest, count, num_prefix)
    assert got.dtype == expected.dtype == torch.int64 and got.shape == expected.shape == (cost.shape[0], count)
    assert torch.equal(got, expected), (count, cost.tolist(), partner.tolist())
    for b in range(cost.shape[0]):
        assert (got[b] - num_prefix).tolist() == greedy_per_image(cost[b].tolist(), partner[b].tolist(), count)


@pytest.mark.parametrize("costs", ["continuous", "ties", "special"])
@pytest.mark.parametrize("partners", PARTNERS)
def test_selects_what_the_loop_selected(costs, partners):
    g = torch.Generator().manual_seed(10 * PARTNERS.index(partners) + len(costs))
    for seed in range(12):
        n = (1, 2, 3, 5, 8, 13, 31)[seed % 7]
        b = 1 + seed % 4
        cost = _costs(costs, b, n, g)
        partner = _partners(partners, cost, g)
        for count in sorted({0, 1, n // 3, n // 2, (n + 1) // 2, n - 1, n}):
            _check(cost, partner, count, num_prefix=seed % 3)


@pytest.mark.parametrize("seed", range(6))
def test_selects_what_the_loop_selected_at_vit_size(seed):
    """196 patch tokens (ViT-B/16 at 224 px), float32 costs as the bound selection computes them."""
    g = torch.Generator().manual_seed(seed)
    cost = _costs(("continuous", "ties")[seed % 2], 4, 196, g, torch.float32)
    partner = _partners(PARTNERS[seed % len(PARTNERS)], cost, g)
    for count in (0, 49, 98, 137, 195, 196):
        _check(cost, partner, count, num_prefix=1)


def test_a_chain_in_cost_order_alternates_over_its_whole_length():
    """Token j's partner is token j + 1, costs increasing: the greedy takes every other token, each
    step depending on all the earlier ones (why no fixed sequence of tensor ops computes it)."""
    n = 40
    cost = torch.arange(n, dtype=torch.float64)[None]
    partner = torch.arange(1, n + 1)[None].clamp_max(n - 1)
    got = matching.select_with_partners(cost, partner, n // 2, 0)
    assert got.tolist() == [list(range(0, n, 2))]
    _check(cost, partner, n // 2, 0)
    _check(cost, partner, n // 2 + 3, 0)  # 3 more than the chain allows: the fill-up takes the cheapest spared


def test_the_bound_selection_on_real_distances():
    """The partners merge_drift finds on random tokens, at every budget."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1 + 24, 8, generator=g, dtype=torch.float64)
    drift, nearest = matching.merge_drift(x, 1, "cosine")
    cost = torch.rand(3, 24, generator=g, dtype=torch.float64) * drift
    for count in range(25):
        _check(cost, nearest - 1, count, num_prefix=1)


def test_the_op_and_its_reference_agree():
    g = torch.Generator().manual_seed(11)
    for n in (1, 4, 17, 64):
        cost = _costs("ties", 5, n, g)
        order = torch.argsort(cost, dim=1, stable=True)
        partner = _partners("random", cost, g)
        for count in (0, n // 2, n):
            got = ops.select_with_partners(order, partner, count)
            assert torch.equal(got, reference.select_with_partners(order, partner, count))


def test_the_uncompiled_fallback_selects_the_same(monkeypatch):
    g = torch.Generator().manual_seed(2)
    cost = _costs("ties", 3, 20, g)
    partner = _partners("mutual", cost, g)
    compiled = matching.select_with_partners(cost, partner + 1, 9, 1)
    monkeypatch.setattr(ops, "_C", None)
    assert torch.equal(matching.select_with_partners(cost, partner + 1, 9, 1), compiled)


def test_the_selection_dispatches_a_fixed_handful_of_operators():
    """The loop dispatched ~13 operators per candidate (2·count candidates); now a few, whatever
    the budget."""
    g = torch.Generator().manual_seed(0)
    cost = torch.rand(2, 196, generator=g)
    nearest = torch.randint(1, 197, (2, 196), generator=g)
    counts = {c: count_aten_ops(matching.select_with_partners, cost, nearest, c, 1) for c in (1, 98, 196)}
    assert len(set(counts.values())) == 1 and counts[98] <= 6, counts
    assert count_aten_ops(select_with_partners_loop, cost, nearest, 98, 1) > 100 * counts[98]


def test_compiles_whole_and_equals_eager():
    g = torch.Generator().manual_seed(4)
    cost = _costs("ties", 3, 30, g)
    nearest = _partners("no_self", cost, g) + 2

    def select(cost, nearest):
        return matching.select_with_partners(cost, nearest, 12, 2)

    compiled = torch.compile(select, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(cost, nearest), select(cost, nearest))


# --- the op's own contract -----------------------------------------------------------------------


def test_the_op_has_a_kernel_per_device_and_a_fake():
    from pullback_ext import _build_info

    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    name = "pullback_ext::select_with_partners"
    assert has_kernel(name, "CPU") and has_kernel(name, "Meta")
    assert has_kernel(name, "CUDA") == bool(_build_info.WITH_CUDA)
    order = torch.stack([torch.randperm(9) for _ in range(2)])
    torch.library.opcheck(torch.ops.pullback_ext.select_with_partners.default, (order, torch.randint(0, 9, (2, 9)), 4))
    meta = ops.select_with_partners(order.to("meta"), order.to("meta"), 4, check_values=False)
    assert meta.shape == (2, 4) and meta.dtype == torch.int64


def _valid():
    order = torch.tensor([[2, 0, 1, 3], [3, 1, 0, 2]])
    return order, torch.tensor([[1, 2, 3, 0], [0, 0, 1, 1]])


@pytest.mark.parametrize("args, error, message", [
    (lambda o, p: (o, p, 5), PullbackError, r"count must be <= n = 4"),
    (lambda o, p: (o, p, -1), PullbackError, r"count must be >= 0"),
    (lambda o, p: (o, p, 1.5), TypeError, r"integer"),
    (lambda o, p: (o.int(), p, 2), TypeError, r"order must be an int64 index tensor"),
    (lambda o, p: (o[0], p, 2), PullbackError, r"order must have 2 dimensions"),
    (lambda o, p: (o, p[:, :3], 2), PullbackError, r"partner must have shape \[B, n\]"),
    (lambda o, p: (o, p[:1], 2), PullbackError, r"partner must have shape \[B, K\]"),
    (lambda o, p: (o, p.float(), 2), TypeError, r"partner must be an int64 index tensor"),
    (lambda o, p: (o, p + 1, 2), IndexError, r"partner\[0, 2\] = 4 is out of range"),
    (lambda o, p: (o - 1, p, 2), IndexError, r"order\[0, 1\] = -1 is out of range"),
    (lambda o, p: (o.clamp_max(2), p, 2), PullbackError, r"order must be a permutation of 0..3 in every row: row 0 holds 2 twice"),
])
def test_bad_arguments_are_refused_with_their_name(args, error, message):
    order, partner = _valid()
    with pytest.raises(error, match=message):
        ops.select_with_partners(*args(order, partner))


def test_unchecked_calls_stay_memory_safe_and_direct_calls_keep_the_invariants():
    order, partner = _valid()
    wild = torch.tensor([[9, -4, 2, 2], [3, 1, 0, 2]])
    got = ops.select_with_partners(wild, torch.tensor([[7, -1, 2, 0], [99, 0, -5, 1]]), 3, check_values=False)
    assert got.shape == (2, 3) and bool(((got >= -1) & (got < 4)).all())
    with pytest.raises(RuntimeError, match="pullback_ext::select_with_partners: internal invariant violated"):
        torch.ops.pullback_ext.select_with_partners(order, partner[:, :3], 2)
    with pytest.raises(RuntimeError, match="pullback_ext::select_with_partners: internal invariant violated"):
        torch.ops.pullback_ext.select_with_partners(order, partner, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [1, 196, 1000, 6000])  # 6000: past shared memory, the scratch path
def test_cuda_selects_what_the_cpu_selects(n):
    g = torch.Generator().manual_seed(n)
    cost = _costs("ties", 3, n, g, torch.float32)
    for kind in ("no_self", "chain_with_cost", "mutual"):
        nearest = _partners(kind, cost, g) + 1
        for count in (0, n // 2, n):
            expected = matching.select_with_partners(cost, nearest, count, 1)
            on_device = cost.cuda(), nearest.cuda()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = matching.select_with_partners(*on_device, count, 1)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert torch.equal(got.cpu(), expected)
