"""The demo's headline: our methods against the original ToMe at matched FLOP ratio, per decoder.

The decoders are the tasks of the task table (:data:`~pullback_ext.comparison.tasks.TASKS`: the
CLS embedding, DPT depth and DPT segmentation). At each ToMe ``r`` of :data:`R` (a *group*), the
rows are the original ToMe (``tome``) and ours at ToMe's cost: importance-guarded ToMe
(``importance_tome``; every merged token is restored to its sources, so a dense decoder reads
full-length features) and, for a dense decoder with an importance head (depth), the paper's
pipeline (``importance`` in prune mode under ``preset="paper"``, full Last-Layer Fusion). Each of ours is
the *least reduced setting whose FLOPs (head included) do not exceed ToMe's* in the group
(:func:`matched_cost`; where no setting reaches that, its most reduced one, labelled so and never
the winner): ``importance_tome`` merges ``r'`` tokens per block, in the blocks the method itself
chooses for ToMe's ``r`` (:func:`~pullback_ext.prune.methods.importance_tome.auto_setting`, the
schedule and blocks of its one-knob rule, chosen on held-out photo crops,
docs/importance_tome_findings.md); on the CLS decoder it is guarded by
the stage's head, on a dense decoder it runs without one (the setting chosen for dense decoders
there; segmentation, which has no importance head, scores at the layer the heads read); the
paper's pipeline takes the prune ratio η of :data:`PAPER_ETAS`. Each row's error against the
unpruned model comes from every held-out image, its cost from
:func:`~pullback_ext.comparison.pareto.measure_cost` on the decoder's own forward: FLOPs (head
included) and wall-clock in interleaved rounds, the speed-up given as the median over the rounds
and its bootstrap 90% interval (``low``, ``high``).

The *winner* of a decoder is computed, never written: in the largest group, the row of lowest mean
error among those at most ToMe's FLOPs whose median measured speed-up exceeds 1 (None when no row is
faster than the unpruned model).

:func:`merges_figure` draws that group on one held-out scene: what each row merged
(:func:`pullback_ext.visualize.comparison_figure`), a row of the picture per row of the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from pullback_ext.comparison import pareto
from pullback_ext.comparison.cost import count_flops
from pullback_ext.comparison.evaluation import PRIMARY
from pullback_ext.comparison.tasks import TASKS
from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods.importance_tome import auto_setting
from pullback_ext.prune.reduction_options import ReductionOptions

R = {True: (16,), False: (8, 16)}
SETTINGS = {True: {"batch": 16, "repeats": 5}, False: {"batch": 32, "repeats": pareto.TIME_REPEATS}}
PAPER_ETAS = tuple(round(0.05 * i, 2) for i in range(1, 19))
UNREACHED = " (its most reduced setting: short of ToMe's cost)"
TASK_LABELS = {name: task.label for name, task in TASKS.items()}  # the decoders of a headline, as printed


@dataclass(frozen=True)
class Setup:
    """One decoder's headline: ``task`` (a name of the task table), its importance ``head`` (None:
    on the CLS decoder ToMe alone, on a dense one ours without the paper's pipeline) scoring block
    ``score_layer``'s output (where ``importance_tome`` scores, head or not), the blocks the paper's
    pipeline prunes at (``prune_layers``), the model's ``num_patches`` and the run size (``quick``)."""

    task: str
    head: object
    score_layer: int
    prune_layers: tuple
    num_patches: int
    quick: bool


def flop_counter(backbone, task: str, image: torch.Tensor) -> Callable[[ReductionOptions], int]:
    """FLOPs of ``task``'s reduced forward on ``image [1, 3, H, W]`` under given options."""
    _, reduced = backbone.forwards(task)
    return lambda options: count_flops(lambda x: reduced(pareto.resolve(options, backbone), x), image)


def matched_cost(candidates: Iterable[ReductionOptions], flops: Callable[[ReductionOptions], int],
                 budget: int) -> tuple[ReductionOptions, bool]:
    """``(options, reached)``: the first of ``candidates`` (ordered from least to most reduced) whose
    ``flops`` do not exceed ``budget``; the most reduced one and False when none does."""
    options = None
    for options in candidates:
        if flops(options) <= budget:
            return options, True
    if options is None:
        raise PullbackError("matched_cost: no candidate settings")
    return options, False


def importance_tome_candidates(backbone, setup: Setup, tome_r: int) -> Iterable[ReductionOptions]:
    """``importance_tome`` on ``backbone`` from the fewest merges up, to match ToMe ``tome_r``'s FLOPs:
    with the ``schedule`` and ``early_merges`` the method chooses itself at ``r = tome_r``
    (:func:`~pullback_ext.prune.methods.importance_tome.auto_setting`), then with the other
    ``early_merges``; no head on a dense decoder. It starts at ``r = tome_r``: with fewer merges per
    block, in no more blocks than ToMe's and a head besides, no setting can cost less than ToMe's."""
    head = None if TASKS[setup.task].dense else setup.head
    at_tome = pareto.resolve(ReductionOptions(strategy="importance_tome", head=head, r=tome_r, score_layer=setup.score_layer),
                             backbone)
    schedule, chosen = auto_setting(at_tome.options, at_tome.backbone)
    for early in (chosen, not chosen):
        for r in range(tome_r, setup.num_patches):
            yield ReductionOptions(strategy="importance_tome", head=head, r=r, score_layer=setup.score_layer, schedule=schedule,
                                   early_merges=early)


def paper_candidates(setup: Setup) -> Iterable[ReductionOptions]:
    """The paper's prune + full LLF pipeline at each η of :data:`PAPER_ETAS`, least reduced first."""
    for eta in PAPER_ETAS:
        yield ReductionOptions(strategy="importance", head=setup.head, ratio=eta, layers=setup.prune_layers, mode="prune",
                               preset="paper")


def _knob(options: ReductionOptions, names: tuple) -> dict:
    return {name: getattr(options, name) for name in names}


def headline_points(backbone, setup: Setup, image: torch.Tensor) -> list:
    """The :class:`~pullback_ext.comparison.pareto.Point` s of one decoder's headline, ours matched to
    ToMe's FLOPs on ``image [1, 3, H, W]``; every knob names its group (``tome_r``)."""
    flops = flop_counter(backbone, setup.task, image)
    dense = TASKS[setup.task].dense
    points = []
    for r in R[setup.quick]:
        tome = ReductionOptions(strategy="tome", r=r)
        points.append(pareto.Point(tome, {"tome_r": r, "r": r}, "tome"))
        if setup.head is None and not dense:  # ours on the CLS decoder is guarded by the head
            continue
        budget = flops(tome)
        ours, reached = matched_cost(importance_tome_candidates(backbone, setup, r), flops, budget)
        label = "importance_tome" if ours.head is not None else "importance_tome (no head)"
        points.append(pareto.Point(ours, {"tome_r": r, **_knob(ours, ("r", "early_merges"))}, label + ("" if reached else UNREACHED)))
        if dense and setup.head is not None:
            paper, reached = matched_cost(paper_candidates(setup), flops, budget)
            points.append(pareto.Point(paper, {"tome_r": r, "eta": paper.ratio},
                                       "importance (paper preset, prune + LLF)" + ("" if reached else UNREACHED)))
    return points


def run_headline(backbone, images: torch.Tensor, setup: Setup, points: list, progress: bool = True) -> dict:
    """Errors and cost of ``points`` (:func:`headline_points`) on ``images [n, 3, H, W]``; JSON-ready
    ``{"metric", "batch", "repeats", "num_images", "rows": [...], "winner"}``, a row per point."""
    metric = PRIMARY[setup.task]
    errors = [e[metric] for e in pareto.image_errors(backbone, images, points, setup.task, progress=progress)]
    batch, repeats = SETTINGS[setup.quick]["batch"], SETTINGS[setup.quick]["repeats"]
    cost = pareto.measure_cost(backbone, images, points, setup.task, (batch,), repeats, progress)
    rows = []
    for p, e, c in zip(points, errors, cost["points"]):
        method = pareto.resolve(p.options, backbone).method
        rows.append({"row": p.row, "method": method.name, "ours": bool(method.ours), "knob": dict(p.knob),
                     "error": pareto.error_summary(e), "flop_ratio": c["flop_ratio"],
                     "speedup": dict(zip(("median", "low", "high"), (c[f"speedup_batch{batch}"], *c[f"speedup_batch{batch}_ci90"])))})
    result = {"metric": metric, "batch": batch, "repeats": repeats, "num_images": int(images.shape[0]), "rows": rows}
    return result | {"winner": winner(result)}


def winner(result: dict) -> dict | None:
    """The row of lowest mean error among those of the largest group (ToMe's largest ``r``) that
    reach ToMe's cost and whose median speed-up exceeds 1; None when none does."""
    top = max(row["knob"]["tome_r"] for row in result["rows"])
    faster = [row for row in result["rows"] if row["knob"]["tome_r"] == top and row["speedup"]["median"] > 1
              and not row["row"].endswith(UNREACHED)]
    return min(faster, key=lambda row: (row["error"]["mean"], -row["speedup"]["median"]), default=None)


def _fmt(value: float) -> str:
    return f"{value:.2e}" if 0 < abs(value) < 0.01 else f"{value:.3f}"


def setting(row: dict) -> str:
    """The row's own knobs, e.g. ``r=22, early_merges=False`` (its group, ToMe's r, left out)."""
    return ", ".join(f"{k}={v}" if isinstance(v, bool) else f"{k}={v:g}" for k, v in row["knob"].items() if k != "tome_r")


def speed(row: dict) -> str:
    """``1.23× (1.10–1.31)``: the measured speed-up's median and 90% interval."""
    s = row["speedup"]
    return f"{s['median']:.2f}× ({s['low']:.2f}–{s['high']:.2f})"


def headline_table(result: dict, title: str) -> str:
    """The headline as markdown: one row per point, the winner named under it."""
    lines = [f"**{title}**: {result['metric']} (mean / p95 over {result['num_images']} held-out scenes) against cost; "
             f"ours at most ToMe's FLOPs at each ToMe r; speed-up at batch {result['batch']}: median over {result['repeats']} "
             "interleaved rounds (bootstrap 90% interval)\n",
             "| at ToMe's cost | row | setting | FLOP ratio | measured speed-up | mean | p95 |", "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        name = f"{row['row']} (ours)" if row["ours"] else row["row"]
        lines.append(f"| r = {row['knob']['tome_r']} | {name} | {setting(row)} | {row['flop_ratio']:.2f} | {speed(row)} | "
                     f"{_fmt(row['error']['mean'])} | {_fmt(row['error']['p95'])} |")
    lines += ["", f"Measured winner: {verdict(result)}", ""]
    return "\n".join(lines)


def verdict(result: dict) -> str:
    """The winner of ``result`` in words, with its numbers and ToMe's at the same cost."""
    best = result["winner"]
    if best is None:
        return "none; no row was faster than the unpruned model on this machine"
    tome = next(r for r in result["rows"] if r["method"] == "tome" and r["knob"]["tome_r"] == best["knob"]["tome_r"])
    text = (f"{best['row']} at {setting(best)}: {result['metric']} {_fmt(best['error']['mean'])}, FLOP ratio "
            f"{best['flop_ratio']:.2f}, {speed(best)}")
    if best == tome:
        return text
    return text + f"; ToMe at r={tome['knob']['r']}: {_fmt(tome['error']['mean'])}, FLOP ratio {tome['flop_ratio']:.2f}, {speed(tome)}"


def figure_blocks(depth: int) -> tuple:
    """The blocks a picture of the merges shows groups after: the middle one and the last (3 and 7
    of the demo's 8)."""
    return (depth // 2 - 1, depth - 1)


def merges_figure(model, task: str, points: list, result: dict, image: torch.Tensor, path, segmentation_head=None) -> dict:
    """The largest group of a headline (ToMe at its largest ``r`` and ours at its cost) drawn on one
    scene ``image [1, 3, H, W]`` and written to ``path`` (PNG), a row per row of the table: the
    groups after :func:`figure_blocks`, the head's importance where the row reads one, and the
    task's image output unreduced and reduced (depth map, class map; the CLS embedding has none).
    The groups are :func:`pullback_ext.visualize.group_maps` of the task's own forward (the
    demo ``model``, its ``segmentation_head`` for segmentation), drawn by
    :func:`~pullback_ext.visualize.comparison_figure`; ``points`` and ``result`` are
    :func:`headline_points` and :func:`run_headline` of ``task``. Returns what it drew, JSON-ready:
    ``{"blocks": [b, ...], "rows": [{"row", "counts": {block: group counts}}]}``."""
    import textwrap

    from pullback_ext.plots import save_figure
    from pullback_ext.visualize import comparison_figure, group_maps

    top = max(row["knob"]["tome_r"] for row in result["rows"])
    blocks = figure_blocks(len(model.backbone.blocks))
    drawn, record = [], []
    for point, row in zip(points, result["rows"]):
        if row["knob"]["tome_r"] != top:
            continue
        maps = group_maps(model, image, blocks, point.options, task=task, segmentation_head=segmentation_head)
        name = textwrap.fill(f"{row['row']}{' (ours)' if row['ours'] else ''}", 36)
        drawn.append((f"{name}\n{setting(row)}, FLOP ratio {row['flop_ratio']:.2f}", maps))
        record.append({"row": row["row"], "counts": {str(b): c for b, c in maps.counts(0).items()}})
    title = f"{TASK_LABELS[task]}: what ToMe and ours merged at the cost of ToMe r = {top}"
    save_figure(comparison_figure(drawn, 0, title), path)
    return {"blocks": list(blocks), "rows": record}
