"""Matched-cost (Pareto) comparison of token reductions.

A *point* is one setting of one method's own knob (ToMe's ``r``, EViT's ``keep_rate``, our ``ratio``
η, ...). A *row* is one method with its selection and averaging rules fixed, swept over its knob;
every row is labelled by those rules (:func:`~pullback_ext.prune.row_rules.describe`). Each point gets per-image errors against
the unpruned model and a cost: FLOPs per image (:data:`~pullback_ext.comparison.cost.FLOP_ACCOUNTING`, one accounting for every
method: torch's flop counter over the task's whole forward at batch 1, scoring, matching and the
importance head included, the task's decoder included and the other task's decoder not) and
wall-clock at several batch sizes from one interleaved timing run
(:func:`~pullback_ext.comparison.cost.interleaved_wall_clock`, :data:`TIME_REPEATS` rounds by
default), as speed-ups over the unpruned model: the median of the per-round ratios with its
bootstrap 90% interval (:func:`~pullback_ext.comparison.cost.speedup_interval`). The FLOP ratio is
the stable axis; measured speed-ups move with the machine's load.

A method whose token counts depend on the other images of a batch
(:attr:`~pullback_ext.prune.methods.base.Method.batch_dependent`: ALGM reduces every image of a batch
by the batch's smallest count, TAP splits its budget by the batch's mean share) is measured one
image at a time, so that its cost and its errors describe one reduction, the one each image gets
alone: its errors at batch 1; its FLOPs per image the mean over the images of each image's count at
batch 1 (their FLOP ratio the unpruned count over that mean: the ratio of the total FLOPs over the
images, not a mean of per-image ratios); its time at batch ``b`` that of the same ``b`` images as
every other point, reduced one after another at batch 1, against the unpruned model's batch of
``b`` (:func:`image_by_image`). Its batched run, where a batch shares its counts, is another
reduction, whose errors are not measured, and is not timed. Every other method runs as before: its
errors in batches, its FLOPs on one image, its time on the batch.

A row's *frontier* on one cost axis and one error statistic is its set of points that no other
point of the row beats on both (at least as fast and at most as wrong, one of them strictly).
The error of a row at a matched speed-up ``s`` is read on that frontier: log-linearly
interpolated between the two frontier points around ``s`` (linearly where one error is 0); below
the row's slowest frontier point its error there (an upper bound, flagged ``bound``); blank above
its fastest point (not reachable).

On a measured axis a matched cell is *within noise* (:func:`mark_noise`) when its row's error band
at ``s`` overlaps that of another row reaching ``s``. A row's band at ``s`` runs from its matched
error with every point placed at the high end of its speed-up interval (the optimistic reading) to
that with every point at the low end (the pessimistic one; unbounded where the row then does not
reach ``s``): where two bands overlap, moving the points within their intervals can swap the two
rows' order at ``s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from pullback_ext.comparison.cost import FLOP_ACCOUNTING, count_flops, interleaved_wall_clock, speedup_interval
from pullback_ext.comparison.evaluation import batched_outputs, label_miou, output_errors
from pullback_ext.comparison.tasks import TASKS
from pullback_ext.errors import PullbackError
from pullback_ext.prune import methods
from pullback_ext.prune.reduction_options import BackboneShape, Reduction, ReductionOptions

MATCHED_SPEEDUPS = (1.1, 1.25, 1.5, 2.0, 3.0)  # 3×: near ToMe's reach on the demo (r = 24: 3.2×)
STATISTICS = ("mean", "median", "p95", "worst")
TIME_REPEATS = 7  # interleaved timing rounds of a page: the fewest that give its speed-up intervals
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
                                         dense_neck=any(TASKS[t].dense for t in backbone.tasks), num_patch=backbone.num_patches))


def error_summary(errors: torch.Tensor) -> dict:
    """``{mean, median, p95, worst, worst_image}`` of per-image errors ``[n]``."""
    e = errors.double().flatten()
    return {"mean": float(e.mean()), "median": float(e.median()), "p95": float(torch.quantile(e, 0.95)),
            "worst": float(e.max()), "worst_image": int(e.argmax())}


def image_by_image(fn: Callable) -> Callable:
    """``fn`` (images -> outputs) run on each image of ``x [b, 3, H, W]`` alone (batch 1), in turn:
    how a ``batch_dependent`` point is costed (see the module docstring). Returns the ``b`` outputs."""
    return lambda x: [fn(x[i:i + 1]) for i in range(x.shape[0])]


def image_errors(backbone, images: torch.Tensor, points: Sequence[Point], task: str, batch_size: int = 16,
                 progress: bool = True, classes: Optional[torch.Tensor] = None) -> list[dict]:
    """Per point, ``{metric: errors [n]}`` on ``images [n, 3, H, W]`` against the unpruned model
    (every metric of ``task``), in batches of ``batch_size``, or of one image for a point whose
    method is ``batch_dependent`` (see the module docstring). With the per-pixel ``classes [n, H, W]``
    of the images (rendered scenes) a segmentation task adds ``label_miou`` and ``label_miou_unpruned``:
    the mIoU of the point's and of the unpruned model's argmax maps against them, over all ``n`` images
    (:func:`~pullback_ext.comparison.evaluation.label_miou`)."""
    from pullback_ext.progress import progress_bar

    reductions = [resolve(p.options, backbone) for p in points]
    data = {} if classes is None else {"classes": classes}
    out = []
    with torch.no_grad():
        full = batched_outputs(backbone.full, images, batch_size)
        unpruned = label_miou(task, full, data)
        for reduction in progress_bar(reductions, desc="pareto quality", enabled=progress, unit="point"):
            size = 1 if reduction.method.batch_dependent else batch_size
            reduced = batched_outputs(lambda x: backbone.reduced(reduction, x), images, size)
            out.append(output_errors(task, reduced, full))
            if unpruned is not None:
                out[-1] |= {"label_miou": label_miou(task, reduced, data), "label_miou_unpruned": unpruned}
    return out


def measure_cost(backbone, images: torch.Tensor, points: Sequence[Point], task: str, batches: Sequence[int] = (1, 64),
                 repeats: int = TIME_REPEATS, progress: bool = True) -> dict:
    """``{"unpruned": entry, "points": [entry per point]}`` of ``task``'s forward on ``images [n, 3, H, W]``
    (:meth:`~pullback_ext.comparison.backbones.Backbone.forwards`), each entry with ``gflops_per_image``
    (batch 1: the first image, or for a point whose method is ``batch_dependent`` the mean over the
    ``n`` images, each alone) and ``batch{b}`` timings (the first ``b`` images, cycled; a
    ``batch_dependent`` point runs them one at a time: :func:`image_by_image`); the point entries add
    ``flop_ratio`` and, per batch, ``speedup_batch{b}`` (the median over ``repeats`` interleaved
    rounds, every point and the unpruned model in each round, of the round's unpruned / point time)
    and ``speedup_batch{b}_ci90`` (``[low, high]``, the bootstrap 90% interval of that median:
    :func:`~pullback_ext.comparison.cost.speedup_interval`)."""
    from pullback_ext.progress import progress_bar

    full, reduced = backbone.forwards(task)
    reductions = [resolve(p.options, backbone) for p in points]
    alone = {i for i, r in enumerate(reductions) if r.method.batch_dependent}
    fns = {"unpruned": full}
    for i, r in enumerate(reductions):
        fn = lambda x, r=r: reduced(r, x)  # noqa: E731
        fns[i] = image_by_image(fn) if i in alone else fn
    counted = {key: images if key in alone else images[:1] for key in fns}
    entries = {key: {"gflops_per_image": count_flops(fn, counted[key]) / counted[key].shape[0] / 1e9} for key, fn in fns.items()}
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
            spread = speedup_interval(base[f"batch{b}"]["times_s"], entry[f"batch{b}"]["times_s"])
            entry[f"speedup_batch{b}"] = spread["median"]
            entry[f"speedup_batch{b}_ci90"] = [spread["low"], spread["high"]]
    return {"unpruned": base, "points": [entries[i] for i in range(len(points))], "batches": list(batches), "repeats": repeats,
            "flops": FLOP_ACCOUNTING}


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
    """The speed-up keys of a :func:`measure_cost` entry: FLOPs (the stable axis), then the measured
    ones (largest batch first)."""
    return ("flop_ratio",) + tuple(f"speedup_batch{b}" for b in sorted(batches, reverse=True))


def error_band(points: Sequence[dict], axis: str, stat: str, target: float) -> Optional[tuple[float, float]]:
    """``(optimistic, pessimistic)`` matched ``stat`` error of one row's ``points`` (entries of
    :func:`summarise`) at speed-up ``target`` on the measured ``axis``, with every point at the high,
    then the low end of its ``{axis}_ci90`` interval (pessimistic ``inf`` where that reading does
    not reach ``target``); None where even the optimistic one does not."""
    ys = [p["error"][stat] for p in points]
    best = matched_error([p["cost"][f"{axis}_ci90"][1] for p in points], ys, target)
    if best is None:
        return None
    worst = matched_error([p["cost"][f"{axis}_ci90"][0] for p in points], ys, target)
    return best["value"], (math.inf if worst is None else worst["value"])


def mark_noise(matched: dict, points: Sequence[dict], rows: Sequence[str], axis: str, targets: Sequence[float]) -> None:
    """Set ``within_noise`` on every reached cell of ``matched[stat][row][target]`` (the matched
    errors on measured ``axis``): True where the row's :func:`error_band` overlaps another row's
    at that target (see the module docstring)."""
    for stat in STATISTICS:
        for t in targets:
            bands = {row: error_band([p for p in points if p["row"] == row], axis, stat, t) for row in rows}
            for row in rows:
                cell, mine = matched[stat][row][f"{t:g}"], bands[row]
                if cell is None:
                    continue
                cell["band"] = None if mine is None else list(mine)
                cell["within_noise"] = mine is not None and any(
                    other is not None and other[0] <= mine[1] and mine[0] <= other[1] for r, other in bands.items() if r != row)


def summarise(points: Sequence[Point], labels: Sequence[str], errors: Sequence[torch.Tensor], cost: dict,
              etas: Sequence[Optional[float]], targets: Sequence[float] = MATCHED_SPEEDUPS,
              extra: Optional[Sequence[dict]] = None) -> dict:
    """JSON-ready results: every point (row, knob, η, error summary, cost, ``one_image_at_a_time``:
    whether its method is ``batch_dependent`` and so measured image by image, see the module
    docstring; and the entries of its ``extra`` dict, one per point, when given) and, per cost axis
    and statistic, each row's matched error at every ``targets`` speed-up (:func:`matched_error`; on
    the measured axes with ``band`` and ``within_noise``, :func:`mark_noise`)."""
    entries = []
    for i, (p, label, e, c, eta) in enumerate(zip(points, labels, errors, cost["points"], etas)):
        entries.append({"row": label, "knob": dict(p.knob), "options": p.options.to_dict(), "eta": eta,
                        "error": error_summary(e), "per_image": [float(v) for v in e.double().flatten()], "cost": c,
                        "one_image_at_a_time": methods.get(p.options.strategy).batch_dependent}
                       | ({} if extra is None else extra[i]))
    rows = list(dict.fromkeys(labels))
    matched: dict = {}
    for axis in cost_axes(cost["batches"]):
        for stat in STATISTICS:
            table = matched.setdefault(axis, {}).setdefault(stat, {})
            for row in rows:
                mine = [e for e in entries if e["row"] == row]
                xs, ys = [e["cost"][axis] for e in mine], [e["error"][stat] for e in mine]
                table[row] = {f"{t:g}": matched_error(xs, ys, t) for t in targets}
        if axis != "flop_ratio":
            mark_noise(matched[axis], entries, rows, axis, targets)
    return {"rows": rows, "points": entries, "matched": matched, "targets": list(targets),
            "unpruned_cost": cost["unpruned"], "batches": cost["batches"], "repeats": cost["repeats"], "flops": cost["flops"]}
