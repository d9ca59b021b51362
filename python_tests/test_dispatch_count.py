"""The operator counter of the benchmarks (``pullback_ext.bench.dispatch``) on functions whose
operator count is known by construction."""

from __future__ import annotations

import torch

from pullback_ext import ops
from pullback_ext.bench.dispatch import OpCounter, count_aten_ops, dispatched_ops


def test_a_sum_of_a_sum_is_two_operators():
    a, b = torch.rand(3), torch.rand(3)
    assert count_aten_ops(lambda a, b: (a + b).sum(), a, b) == 2
    assert dispatched_ops(lambda a, b: (a + b).sum(), a, b) == {"aten::add.Tensor": 1, "aten::sum": 1}


def test_keyword_arguments_reach_the_function():
    assert count_aten_ops(lambda a, *, scale: a * scale, torch.rand(2), scale=torch.rand(2)) == 1


def _inner(x):
    return x.exp()  # 1


class _Block(torch.nn.Module):
    def forward(self, x):
        return _inner(x) + 1  # 2


def test_nested_calls_count_every_operator():
    """Operators issued inside nested Python calls, a module and a loop all count: 3 blocks of 2,
    then a view and a mean (a counter of the outer function's calls alone would see 1)."""
    blocks = torch.nn.Sequential(_Block(), _Block(), _Block())

    def forward(x):
        return blocks(x).view(-1).mean()

    assert count_aten_ops(forward, torch.rand(2, 3)) == 3 * 2 + 2


def test_composite_operators_count_what_they_decompose_into():
    """``torch.nn.functional.linear`` is a composite: what runs is a transpose and a matmul-add."""
    x, w, b = torch.rand(4, 3), torch.rand(2, 3), torch.rand(2)
    assert dispatched_ops(torch.nn.functional.linear, x, w, b) == {"aten::t": 1, "aten::addmm": 1}


def test_counters_inside_counters_both_count_everything():
    """A count taken inside a function that is counted: the inner operators reach both modes."""
    a = torch.rand(3)
    inner = []

    def outer(a):
        inner.append(count_aten_ops(lambda a: (a * 2).exp(), a))  # 2
        return a.sin()  # 1

    assert count_aten_ops(outer, a) == 3 and inner == [2]


def test_an_op_of_the_extension_is_one_operator_however_many_it_runs_inside():
    x, idx = torch.rand(2, 5, 3), torch.tensor([[0, 4], [1, 1]])
    counts = dispatched_ops(lambda: ops.gather_tokens(x, idx, check_values=False))
    if ops.uses_compiled(x):
        assert counts == {"pullback_ext::gather_tokens": 1}  # its output allocation is not counted again
    else:  # the reference: unsqueeze, expand, gather
        assert counts == {"aten::unsqueeze": 1, "aten::expand": 1, "aten::gather": 1}


def test_the_counter_runs_without_gradients_and_returns_the_counts():
    w = torch.rand(3, requires_grad=True)
    with OpCounter() as counter:
        (w * 2).sum()
    assert counter.total == 2 and counter.counts["aten::mul.Tensor"] == 1
    grads = []
    count_aten_ops(lambda: grads.append(torch.is_grad_enabled()))
    assert grads == [False]
