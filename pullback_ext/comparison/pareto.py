"""Matched-cost (Pareto) comparison of token reductions.

A *point* is one setting of one method's own knob (ToMe's ``r``, EViT's ``keep_rate``, our ``ratio``
η, ...). A *row* is one method with its selection and averaging rules fixed, swept over its knob;
every row is labelled by those rules (:func:`~pullback_ext.prune.row_rules.describe`). Each point gets per-image errors against
the unpruned model and a cost: FLOPs per image (one accounting for every method: torch's flop
counter over the whole reduced forward, scoring, matching and the importance head included) and
wall-clock at several batch sizes from one interleaved timing run
(:func:`~pullback_ext.comparison.cost.interleaved_wall_clock`), as speed-ups over the unpruned model.

A row's *frontier* on one cost axis and one error statistic is its set of points that no other
point of the row beats on both (at least as fast and at most as wrong, one of them strictly).
The error of a row at a matched speed-up ``s`` is read on that frontier: log-linearly
interpolated between the two frontier points around ``s`` (linearly where one error is 0); below
the row's slowest frontier point its error there (an upper bound, flagged ``bound``); blank above
its fastest point (not reachable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pullback_ext.comparison.cost import count_flops, interleaved_wall_clock
from pullback_ext.comparison.evaluation import batched_outputs, output_errors
from pullback_ext.errors import PullbackError
from pullback_ext.prune.reduction_options import BackboneShape, Reduction, ReductionOptions

MATCHED_SPEEDUPS = (1.1, 1.25, 1.5, 2.0)
STATISTICS = ("mean", "p95", "worst")
@dataclass(frozen=True)
class Point:
    """One setting of one method: ``options`` (unresolved), the ``knob`` values that set it
    (``{"r": 8}``), and its ``row`` label (from :func:`~pullback_ext.prune.row_rules.describe` unless given)."""

    options: ReductionOptions
    knob: dict = field(default_factory=dict, hash=False, compare=False)
    row: str = ""


def resolve(options: ReductionOptions, backbone) -> Reduction:
    """``options`` resolved for a :class:`~pullback_ext.comparison.backbones.Backbone`."""
    return options.resolve(BackboneShape(depth=backbone.depth, num_prefix=backbone.num_prefix, has_cls=backbone.has_cls,
                                         dense_neck="depth" in backbone.tasks))


def error_summary(errors: torch.Tensor) -> dict:
    """``{mean, median, p95, worst, worst_image}`` of per-image errors ``[n]``."""
    e = errors.double().flatten()
    return {"mean": float(e.mean()), "median": float(e.median()), "p95": float(torch.quantile(e, 0.95)),
            "worst": float(e.max()), "worst_image": int(e.argmax())}


def image_errors(backbone, images: torch.Tensor, points: Sequence[Point], task: str, batch_size: int = 16,
                 progress: bool = True) -> list[dict]:
    """Per point, ``{metric: errors [n]}`` on ``images [n, 3, H, W]`` against the unpruned model."""
    from pullback_ext.progress import progress_bar

    reductions = [resolve(p.options, backbone) for p in points]
    out = []
    with torch.no_grad():
        full = batched_outputs(backbone.full, images, batch_size)
        for reduction in progress_bar(reductions, desc="pareto quality", enabled=progress, unit="point"):
            reduced = batched_outputs(lambda x: backbone.reduced(reduction, x), images, batch_size)
            out.append(output_errors(task, reduced, full))
    return out


def measure_cost(backbone, images: torch.Tensor, points: Sequence[Point], batches: Sequence[int] = (1, 64),
                 repeats: int = 3, progress: bool = True) -> dict:
    """``{"unpruned": entry, "points": [entry per point]}``, each entry with ``gflops_per_image``
    (batch 1) and ``batch{b}`` timings; the point entries add ``flop_ratio`` and ``speedup_batch{b}``
    (medians over ``repeats`` interleaved rounds, every point and the unpruned model in each round)."""
    from pullback_ext.progress import progress_bar

    reductions = [resolve(p.options, backbone) for p in points]
    fns = {"unpruned": backbone.full} | {i: (lambda x, r=r: backbone.reduced(r, x)) for i, r in enumerate(reductions)}
    one = images[:1]
    entries = {key: {"gflops_per_image": count_flops(fn, one) / 1e9} for key, fn in fns.items()}
    for b in progress_bar(batches, desc="pareto timing", enabled=progress, unit="batch size"):
        x = images[torch.arange(b) % images.shape[0]]
        timed = interleaved_wall_clock({key: (lambda fn=fn: fn(x)) for key, fn in fns.items()}, repeats=repeats,
                                       device=images.device)
        for key, t in timed.items():
            entries[key][f"batch{b}"] = t
    base = entries.pop("unpruned")
    for entry in entries.values():
        entry["flop_ratio"] = base["gflops_per_image"] / entry["gflops_per_image"]
        for b in batches:
            entry[f"speedup_batch{b}"] = base[f"batch{b}"]["median_s"] / entry[f"batch{b}"]["median_s"]
    return {"unpruned": base, "points": [entries[i] for i in range(len(points))], "batches": list(batches), "repeats": repeats}


def frontier(speedups: Sequence[float], errors: Sequence[float]) -> list[int]:
    """Indices of the non-dominated points, by increasing speed-up (see the module docstring)."""
    if len(speedups) != len(errors):
        raise PullbackError(f"frontier: {len(speedups)} speed-ups for {len(errors)} errors")
    order = sorted(range(len(speedups)), key=lambda i: (-speedups[i], errors[i]))
    kept, best = [], math.inf
    for i in order:  # fastest first: a point stays if it is less wrong than every faster one
        if errors[i] < best:
            kept.append(i)
            best = errors[i]
    return kept[::-1]


def matched_error(speedups: Sequence[float], errors: Sequence[float], target: float) -> Optional[dict]:
    """The error of a row at speed-up ``target`` on its frontier: ``{value, bound}`` or None when
    the row is never that fast (see the module docstring)."""
    idx = frontier(speedups, errors)
    xs, ys = [speedups[i] for i in idx], [errors[i] for i in idx]
    if not xs or target > xs[-1]:
        return None
    if target <= xs[0]:
        return {"value": ys[0], "bound": target < xs[0]}
    j = next(j for j in range(1, len(xs)) if xs[j] >= target)
    t = (target - xs[j - 1]) / (xs[j] - xs[j - 1])
    lo, hi = ys[j - 1], ys[j]
    value = lo + t * (hi - lo) if min(lo, hi) <= 0 else math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo)))
    return {"value": value, "bound": False}


def cost_axes(batches: Sequence[int]) -> tuple[str, ...]:
    """The speed-up keys of a :func:`measure_cost` entry: measured ones (largest batch first), then FLOPs."""
    return tuple(f"speedup_batch{b}" for b in sorted(batches, reverse=True)) + ("flop_ratio",)


def summarise(points: Sequence[Point], labels: Sequence[str], errors: Sequence[torch.Tensor], cost: dict,
              etas: Sequence[Optional[float]], targets: Sequence[float] = MATCHED_SPEEDUPS) -> dict:
    """JSON-ready results: every point (row, knob, η, error summary, cost) and, per cost axis and
    statistic, each row's matched error at every ``targets`` speed-up (:func:`matched_error`)."""
    entries = []
    for p, label, e, c, eta in zip(points, labels, errors, cost["points"], etas):
        entries.append({"row": label, "knob": dict(p.knob), "options": p.options.to_dict(), "eta": eta,
                        "error": error_summary(e), "per_image": [float(v) for v in e.double().flatten()], "cost": c})
    rows = list(dict.fromkeys(labels))
    matched: dict = {}
    for axis in cost_axes(cost["batches"]):
        for stat in STATISTICS:
            table = matched.setdefault(axis, {}).setdefault(stat, {})
            for row in rows:
                mine = [e for e in entries if e["row"] == row]
                xs, ys = [e["cost"][axis] for e in mine], [e["error"][stat] for e in mine]
                table[row] = {f"{t:g}": matched_error(xs, ys, t) for t in targets}
    return {"rows": rows, "points": entries, "matched": matched, "targets": list(targets),
            "unpruned_cost": cost["unpruned"], "batches": cost["batches"], "repeats": cost["repeats"]}
