"""Evaluation outputs: JSON, markdown table and the quality-against-cost plot, written atomically."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pullback_ext.comparison.evaluation import METRICS
from pullback_ext.fileio import atomic_write_json, atomic_write_text
from pullback_ext.plots import decade_limits, log_floor, log_series, note_floor, outside_legend, pyplot, save_figure


def write_json(obj: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    atomic_write_json(path, obj)
    return path


def write_text(text: str, path: str | os.PathLike) -> Path:
    path = Path(path)
    atomic_write_text(path, text)
    return path


def method_colours() -> dict:
    """The one colour table of every figure that draws methods: ``{method name: RGBA}`` for each
    method of the registry (:func:`pullback_ext.prune.methods.all_methods`), in its order. The
    strong colours (tab10, then Dark2) go to ours first, then to the original methods, then to the
    criteria; the light tab20 shades after them."""
    from pullback_ext.prune.methods import all_methods

    plt = pyplot()
    strong = [plt.get_cmap("tab10")(i) for i in range(10)] + [plt.get_cmap("Dark2")(i) for i in range(8)]
    table = strong + [plt.get_cmap("tab20")(2 * i + 1) for i in range(10)]
    methods = all_methods()
    ranked = sorted(range(len(methods)), key=lambda i: (0 if methods[i].ours else 1 if methods[i].kind == "original" else 2, i))
    colour = {methods[i].name: table[k % len(table)] for k, i in enumerate(ranked)}
    return {m.name: colour[m.name] for m in methods}


def method_of(row: str):
    """The registered method of a row key (``"importance (paper preset)"`` names its method first)."""
    from pullback_ext.prune.methods import get

    return get(row.split(" ")[0])


def method_style(row: str) -> dict:
    """Line2D keywords of the row ``row``: its method's colour of :func:`method_colours`; a
    method of ours (the registry's ``ours``) is drawn thicker with a star marker."""
    method = method_of(row)
    style = {"color": method_colours()[method.name]}
    return style | ({"lw": 2.2, "marker": "*", "ms": 9} if method.ours else {})


# (table key, linestyle, marker, legend suffix): LLF variants differ in linestyle and marker
VARIANTS = (("merge", "-", "o", ""), ("llf", "-", "o", ""), ("llf_full", ":", "s", " (full LLF)"), ("no_llf", "--", "^", " (no LLF)"))
METRIC_TITLES = {"cosine_x100": "100·(1 − cos) of the CLS embedding", "silog_x100": "added SILog ×100 of the depth map",
                 "knn_top1": "k-NN top-1 accuracy"}
COST_TITLE = "FLOP ratio (unpruned / reduced, scoring included)"


def _series(result: dict, metric: str) -> list[dict]:
    """Every line of one panel: ``{label, method, ls, marker, x, mean, std}``; x is the FLOP ratio
    of each cell (``result["flop_ratio"]``; the prune ratio η where a result has none). A row
    identical to an earlier one (same x and means) is left out and named in the earlier's label."""
    ratios, costs = result["ratios"], result.get("flop_ratio")
    out: list[dict] = []
    for key, ls, marker, suffix in VARIANTS:
        for row, by_ratio in result["tables"].get(key, {}).items():
            x = [costs[key][row][f"{r:g}"] for r in ratios] if costs else list(ratios)
            mean = np.array([by_ratio[f"{r:g}"][metric]["mean"] for r in ratios], dtype=float)
            std = np.array([by_ratio[f"{r:g}"][metric].get("std", 0.0) for r in ratios], dtype=float)
            twin = next((s for s in out if s["x"] == x and np.array_equal(s["mean"], mean)), None)
            if twin is not None:
                twin["label"] += f" (= {row}{suffix}, drawn once)"
                continue
            out.append({"label": row + suffix, "method": row, "ls": ls, "marker": marker, "x": x, "mean": mean, "std": std})
    for row in result.get("headline", {}).get("rows", []) if result.get("headline", {}).get("metric") == metric else []:
        line = next((s for s in out if s.get("headline_row") == row["row"]), None)
        if line is None:
            line = {"label": f"{row['row']} (headline, ToMe's r)", "method": row["method"], "ls": "-.", "marker": "D",
                    "x": [], "mean": np.array([]), "std": None, "headline_row": row["row"]}
            out.append(line)
        line["x"].append(row["flop_ratio"])
        line["mean"] = np.append(line["mean"], row["error"]["mean"])
    return out


def _quality_panel(ax, result: dict, metric: str) -> None:
    """Mean error against FLOP ratio per row (colour: its method, :func:`~pullback_ext.plots.method_style`;
    linestyle: its LLF variant) on a log axis; with several seeds the std across seeds as a band,
    for a row whose mean − std stays positive (a log axis cannot show the rest)."""
    series = _series(result, metric)
    floor, clipped = log_floor(np.concatenate([s["mean"] for s in series])), 0
    banded = False
    for s in series:
        style = {"marker": s["marker"], "ms": 4} | method_style(s["method"])
        if "paper preset" in s["label"]:  # the other preset of the same method: hollow markers
            style["mfc"] = "none"
        ours = " — ours" if method_of(s["method"]).ours else ""
        clipped += log_series(ax, s["x"], s["mean"], floor, ls=s["ls"], label=s["label"] + ours, **style)
        if result.get("seeds", 1) > 1 and s["std"] is not None and (s["mean"] - s["std"] > 0).all():  # a log axis shows > 0 only
            ax.fill_between(s["x"], s["mean"] - s["std"], s["mean"] + s["std"], color=style["color"], alpha=0.12, lw=0)
            banded = True
    if banded:
        ax.fill_between([], [], [], color="gray", alpha=0.25, lw=0, label=f"band: ± std of the mean across {result['seeds']} seeds (where it stays > 0)")
    ax.set_yscale("log")
    decade_limits(ax)
    note_floor(ax, floor, clipped)
    ax.set_xlabel(COST_TITLE if result.get("flop_ratio") else "prune ratio η (fraction of tokens removed)")
    ax.set_ylabel(METRIC_TITLES.get(metric, metric))
    ax.grid(alpha=0.3, which="both")


def quality_figure(result: dict):
    """One panel per metric of ``result`` (:func:`pullback_ext.comparison.evaluation.run_quality`,
    with ``flop_ratio`` from :func:`~pullback_ext.comparison.evaluation.run_flop_ratios` and
    optionally a ``headline``): mean error against cost for each row, log y; prune mode without
    LLF dashed with triangles, full LLF dotted with squares, the every-block merges of the
    headline dash-dotted; ours thicker with a star. The legend sits right of the panels."""
    plt = pyplot()
    metrics = METRICS[result["task"]]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics) + 3, 4.2), squeeze=False, layout="constrained")
    for ax, metric in zip(axes[0], metrics):
        _quality_panel(ax, result, metric)
    outside_legend(fig, max(axes[0], key=lambda ax: len(ax.get_legend_handles_labels()[1])))
    fig.suptitle(f"{result['task']} / {result['mode']} at layers {result['layers']} (lower is better)", fontsize=10, x=0.02, ha="left")
    return fig


def plot_quality(result: dict, path: str | os.PathLike) -> Path:
    """:func:`quality_figure` written to ``path``."""
    return save_figure(quality_figure(result), path)
