"""The demo's headline: our methods against the original ToMe at matched FLOP ratio, per decoder.

At each ToMe ``r`` of :data:`R`, the rows are the original ToMe (``tome``), importance-guarded
ToMe (``importance_tome``, with the stage's importance head of that decoder; every merged token is
restored to its sources, so a dense decoder reads full-length features) and, for depth, the
paper's pipeline (``importance`` in prune mode under ``preset="paper"``, full Last-Layer Fusion)
at the prune ratio η whose patch-token budget over the blocks is closest to ToMe's. Each row's
error against the unpruned model comes from every held-out image, its cost from
:func:`~pullback_ext.comparison.pareto.measure_cost` on the decoder's own forward: FLOPs (head
included) and wall-clock in interleaved rounds, the speed-up given as the median over the rounds
and its bootstrap 90% interval (``low``, ``high``).

The *winner* of a decoder is computed, never written: at the largest ``r``, the row of lowest
mean error among those whose median measured speed-up exceeds 1 (None when no row is faster
than the unpruned model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pullback_ext.comparison import pareto
from pullback_ext.comparison.evaluation import PRIMARY
from pullback_ext.prune.reduction_options import ReductionOptions

R = {True: (16,), False: (8, 16)}
SETTINGS = {True: {"batch": 16, "repeats": 5}, False: {"batch": 32, "repeats": pareto.TIME_REPEATS}}
PAPER_ETAS = tuple(round(0.05 * i, 2) for i in range(1, 19))


@dataclass(frozen=True)
class Setup:
    """One decoder's headline: ``task`` (cls / depth), its importance ``head`` (None: ToMe alone)
    scoring block ``score_layer``'s output, the blocks the paper's pipeline prunes at
    (``prune_layers``), the model's ``num_patches`` and the run size (``quick``)."""

    task: str
    head: object
    score_layer: int
    prune_layers: tuple
    num_patches: int
    quick: bool


def _tokens(backbone, options: ReductionOptions, num_patches: int) -> int:
    """Patch tokens summed over the blocks under ``options`` (the budget FLOPs follow)."""
    reduction = pareto.resolve(options, backbone)
    return sum(reduction.method.patch_tokens_per_block(reduction, num_patches))


def paper_options(backbone, setup: Setup, budget: int) -> ReductionOptions:
    """The paper's prune + LLF setting whose η of :data:`PAPER_ETAS` comes closest to the
    patch-token ``budget`` (summed over the blocks)."""
    candidates = [ReductionOptions(strategy="importance", head=setup.head, ratio=eta, layers=setup.prune_layers, mode="prune",
                                   preset="paper") for eta in PAPER_ETAS]
    return min(candidates, key=lambda o: abs(_tokens(backbone, o, setup.num_patches) - budget))


def headline_points(backbone, setup: Setup) -> list:
    """The :class:`~pullback_ext.comparison.pareto.Point` s of one decoder's headline."""
    points = []
    for r in R[setup.quick]:
        tome = ReductionOptions(strategy="tome", r=r)
        points.append(pareto.Point(tome, {"r": r}, "tome"))
        if setup.head is None:
            continue
        points.append(pareto.Point(ReductionOptions(strategy="importance_tome", head=setup.head, r=r, score_layer=setup.score_layer),
                                   {"r": r}, "importance_tome"))
        if setup.task == "depth":
            paper = paper_options(backbone, setup, _tokens(backbone, tome, setup.num_patches))
            points.append(pareto.Point(paper, {"r": r, "eta": paper.ratio}, "importance (paper preset, prune + LLF)"))
    return points


def run_headline(backbone, images: torch.Tensor, setup: Setup, progress: bool = True) -> dict:
    """Errors and cost of :func:`headline_points` on ``images [n, 3, H, W]``; JSON-ready
    ``{"metric", "batch", "repeats", "num_images", "rows": [...], "winner"}``."""
    points = headline_points(backbone, setup)
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
    """The row of lowest mean error among those of the largest ``r`` whose median speed-up
    exceeds 1; None when none does."""
    top = max(row["knob"]["r"] for row in result["rows"])
    faster = [row for row in result["rows"] if row["knob"]["r"] == top and row["speedup"]["median"] > 1]
    return min(faster, key=lambda row: (row["error"]["mean"], -row["speedup"]["median"]), default=None)


def _fmt(value: float) -> str:
    return f"{value:.2e}" if 0 < abs(value) < 0.01 else f"{value:.3f}"


def _knob(row: dict) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in row["knob"].items())


def speed(row: dict) -> str:
    """``1.23× (1.10–1.31)``: the measured speed-up's median and 90% interval."""
    s = row["speedup"]
    return f"{s['median']:.2f}× ({s['low']:.2f}–{s['high']:.2f})"


def headline_table(result: dict, title: str) -> str:
    """The headline as markdown: one row per point, the winner named under it."""
    lines = [f"**{title}**: {result['metric']} (mean / p95 over {result['num_images']} held-out scenes) against cost; "
             f"speed-up at batch {result['batch']}: median over {result['repeats']} interleaved rounds (bootstrap 90% interval)\n",
             "| row | setting | FLOP ratio | measured speed-up | mean | p95 |", "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        name = f"{row['row']} (ours)" if row["ours"] else row["row"]
        lines.append(f"| {name} | {_knob(row)} | {row['flop_ratio']:.2f} | {speed(row)} | "
                     f"{_fmt(row['error']['mean'])} | {_fmt(row['error']['p95'])} |")
    lines += ["", f"Measured winner: {verdict(result)}", ""]
    return "\n".join(lines)


def verdict(result: dict) -> str:
    """The winner of ``result`` in words, with its numbers and ToMe's at the same ``r``."""
    best = result["winner"]
    if best is None:
        return "none; no row was faster than the unpruned model on this machine"
    tome = next(r for r in result["rows"] if r["method"] == "tome" and r["knob"]["r"] == best["knob"]["r"])
    text = (f"{best['row']} at {_knob(best)}: {result['metric']} {_fmt(best['error']['mean'])}, FLOP ratio "
            f"{best['flop_ratio']:.2f}, {speed(best)}")
    if best is tome:
        return text
    return text + f"; ToMe there: {_fmt(tome['error']['mean'])}, FLOP ratio {tome['flop_ratio']:.2f}, {speed(tome)}"
