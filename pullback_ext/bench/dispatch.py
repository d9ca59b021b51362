"""How many operators one eager call dispatches: the launch-bound cost that FLOPs do not show.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every operator that reaches the
dispatcher below autograd, wherever in the call it is issued (nested functions, modules, other
dispatch modes underneath or on top). Composite operators arrive already decomposed, so what is
counted is what runs: ``torch.matmul`` of two matrices is one ``aten.mm``, a view is one op, and
an op of this extension (``torch.ops.pullback_ext.*``) is one op however much work its kernel does
(operators a kernel calls internally are not re-dispatched to the mode). Under
``torch.compile`` the dispatched operators are those of the compiled graph's runtime, not the
model's: count eager calls.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts every operator dispatched while it is active: ``counts`` maps the operator's name
    (``"aten::add.Tensor"``; ``"aten::sum"`` for a default overload) to the number of calls."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.name()] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def dispatched_ops(fn: Callable, *args, **kwargs) -> Counter:
    """The operators one eager ``fn(*args, **kwargs)`` dispatches, by name, under ``torch.no_grad``."""
    counter = OpCounter()
    with torch.no_grad(), counter:
        fn(*args, **kwargs)
    return counter.counts


def count_aten_ops(fn: Callable, *args, **kwargs) -> int:
    """Operators one eager ``fn(*args, **kwargs)`` dispatches (ATen's and this extension's), under
    ``torch.no_grad``."""
    return sum(dispatched_ops(fn, *args, **kwargs).values())
