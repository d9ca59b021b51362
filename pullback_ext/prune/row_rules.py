"""The rules a token-reduction row is labelled by: which tokens it selects and how it averages.

Every comparison table of ``pullback evaluate`` (plain and ``--pareto``) names, for each row, the
method, its selection rule and its averaging rule, so that no row is known by a strategy name
alone; each method states its own (:meth:`~pullback_ext.prune.methods.base.Method.describe`).
"""

from __future__ import annotations

from pullback_ext.prune.methods.base import Reduction


def describe(reduction: Reduction) -> dict:
    """``{method, selection, averaging}`` of a resolved reduction: the rules its row is labelled by."""
    return reduction.method.describe(reduction)


def row_label(reduction: Reduction) -> str:
    d = describe(reduction)
    return f"{d['method']} · {d['selection']} · {d['averaging']}"
