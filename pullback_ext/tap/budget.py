"""TAP's exact removal budget: the final keep count, and its split over the eligible layers.

For a final keep rate ρ and ``N`` patch tokens, exactly ``K = floor(ρ·N + 0.5)`` patch tokens remain
after the last reduction, for every image and every ρ (``N − K`` are removed in total). The split
over the ``L`` eligible layers is planned again at each of them: the register's read-out at layer
``j`` gives shares over the layers ``j..L−1`` that are still to come, the tokens still to remove are
turned into integer counts by the largest-remainder rule, and layer ``j`` removes its count. The
last layer's share is 1, so it removes whatever remains: the total is exact by construction, never
approximately.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from pullback_ext.errors import PullbackError


def keep_count(rho: float, num_patch: int) -> int:
    """Patch tokens left after the last reduction: ``floor(ρ·N + 0.5)``."""
    if not 0.0 < float(rho) <= 1.0:
        raise PullbackError(f"keep rate ρ must lie in (0, 1]; got {rho!r}")
    return int(math.floor(float(rho) * num_patch + 0.5))


def largest_remainder(total: int, shares: Sequence[float]) -> list[int]:
    """Integer counts adding up to exactly ``total``, proportional to ``shares`` (>= 0, not all 0).

    Each layer gets the floor of its quota ``total · s_i / Σ s``; the tokens left over go one each
    to the largest fractional parts (ties: the earlier layer).
    """
    values = [float(s) for s in shares]
    if not values or any(not math.isfinite(s) or s < 0 for s in values) or sum(values) <= 0:
        raise PullbackError(f"shares must be finite, >= 0 and not all 0; got {values}")
    quotas = [total * s / sum(values) for s in values]
    counts = [int(math.floor(q)) for q in quotas]
    order = sorted(range(len(values)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def tokens_per_block(layers: tuple, task: str, rho: float, num_patch: int, depth: int) -> list[Optional[int]]:
    """Patch tokens each of the ``depth`` blocks processes (the register not counted) for eligible
    ``layers = (start, stop)``: ``num_patch`` before ``start``, exactly ``keep_count(rho, num_patch)``
    from the last eligible layer ``stop − 1`` on (dense ``task``: the last block runs on all of them
    again, Last-Layer Fusion), and None in between: there the split follows the register's read-out
    averaged over the batch, so it is one count for every image of a batch and may differ between
    batches."""
    start, stop = layers
    kept = keep_count(rho, num_patch)
    counts: list[Optional[int]] = [num_patch if i < start or kept == num_patch else kept if i >= stop - 1 else None
                                   for i in range(depth)]
    if task != "cls" and kept < num_patch:
        counts[-1] = num_patch
    return counts


class BudgetPlan:
    """The tokens still to remove, handed out one eligible layer at a time.

    ``num_patch`` patch tokens, keep rate ``rho``, ``num_layers`` eligible layers. :meth:`take`
    at layer ``j`` (0-based among the eligible ones, called in order) splits what is left over the
    layers ``j..L−1`` by ``shares`` and returns layer ``j``'s count.
    """

    def __init__(self, num_patch: int, rho: float, num_layers: int):
        self.total = num_patch - keep_count(rho, num_patch)
        self.remaining = self.total
        self.num_layers = num_layers
        self.next_layer = 0

    def take(self, layer: int, shares: Sequence[float]) -> int:
        """Tokens layer ``layer`` removes, given ``shares`` over the layers ``layer..L−1``."""
        if layer != self.next_layer or len(shares) != self.num_layers - layer:
            raise PullbackError(f"budget plan: expected layer {self.next_layer} with {self.num_layers - self.next_layer} "
                                f"shares, got layer {layer} with {len(shares)}")
        count = largest_remainder(self.remaining, shares)[0] if self.remaining else 0
        self.remaining -= count
        self.next_layer += 1
        return count
