"""The demo's headline: our methods against the original ToMe at matched FLOP ratio, per decoder.

At each ToMe ``r`` of :data:`R` (a *group*), the rows are the original ToMe (``tome``) and ours at
ToMe's cost: importance-guarded ToMe (``importance_tome``; every merged token is restored to its
sources, so a dense decoder reads full-length features) and, for depth, the paper's pipeline
(``importance`` in prune mode under ``preset="paper"``, full Last-Layer Fusion). Each of ours is
the *least reduced setting whose FLOPs (head included) do not exceed ToMe's* in the group
(:func:`matched_cost`; where no setting reaches that, its most reduced one, labelled so and never
the winner): ``importance_tome`` merges ``r'`` tokens per block, in the blocks the method itself
chooses for ToMe's ``r`` (:func:`~pullback_ext.prune.methods.importance_tome.auto_setting`: after
the head's layer while ToMe's FLOP ratio there is within
:data:`~pullback_ext.prune.methods.importance_tome.GUARDED_REACH`, and with ToMe's rule in the
blocks before too beyond it; the crossover chosen on held-out photo crops,
docs/importance_tome_findings.md); on the CLS decoder it is guarded by
the stage's head, on depth it runs without one (the setting chosen for dense decoders there); the
paper's pipeline takes the prune ratio η of :data:`PAPER_ETAS`. Each row's error against the
unpruned model comes from every held-out image, its cost from
:func:`~pullback_ext.comparison.pareto.measure_cost` on the decoder's own forward: FLOPs (head
included) and wall-clock in interleaved rounds, the speed-up given as the median over the rounds
and its bootstrap 90% interval (``low``, ``high``).

The *winner* of a decoder is computed, never written: in the largest group, the row of lowest mean
error among those at most ToMe's FLOPs whose median measured speed-up exceeds 1 (None when no row is
faster than the unpruned model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from pullback_ext.comparison import pareto
from pullback_ext.comparison.cost import count_flops
from pullback_ext.comparison.evaluation import PRIMARY
from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods.importance_tome import auto_setting
from pullback_ext.prune.reduction_options import ReductionOptions

R = {True: (16,), False: (8, 16)}
SETTINGS = {True: {"batch": 16, "repeats": 5}, False: {"batch": 32, "repeats": pareto.TIME_REPEATS}}
PAPER_ETAS = tuple(round(0.05 * i, 2) for i in range(1, 19))
UNREACHED = " (its most reduced setting: short of ToMe's cost)"
TASK_LABELS = {"cls": "CLS embedding", "depth": "DPT depth"}  # the decoders of a headline, as printed


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
    head = setup.head if setup.task == "cls" else None
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
    points = []
    for r in R[setup.quick]:
        tome = ReductionOptions(strategy="tome", r=r)
        points.append(pareto.Point(tome, {"tome_r": r, "r": r}, "tome"))
        if setup.head is None:
            continue
        budget = flops(tome)
        ours, reached = matched_cost(importance_tome_candidates(backbone, setup, r), flops, budget)
        label = "importance_tome" if ours.head is not None else "importance_tome (no head)"
        points.append(pareto.Point(ours, {"tome_r": r, **_knob(ours, ("r", "early_merges"))}, label + ("" if reached else UNREACHED)))
        if setup.task == "depth":
            paper, reached = matched_cost(paper_candidates(setup), flops, budget)
            points.append(pareto.Point(paper, {"tome_r": r, "eta": paper.ratio},
                                       "importance (paper preset, prune + LLF)" + ("" if reached else UNREACHED)))
    return points


def run_headline(backbone, images: torch.Tensor, setup: Setup, progress: bool = True) -> dict:
    """Errors and cost of :func:`headline_points` on ``images [n, 3, H, W]``; JSON-ready
    ``{"metric", "batch", "repeats", "num_images", "rows": [...], "winner"}``."""
    points = headline_points(backbone, setup, images[:1])
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
