"""Evaluation outputs: JSON, markdown table and the quality-against-ratio plot, written atomically."""

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


# (table key, linestyle, marker, legend suffix): LLF variants differ in linestyle and marker
VARIANTS = (("merge", "-", "o", ""), ("llf", "-", "o", ""), ("llf_full", ":", "s", " (full LLF)"), ("no_llf", "--", "^", " (no LLF)"))
METRIC_TITLES = {"cosine_x100": "cosine distance ×100 (to the unpruned output)", "silog_x100": "added SILog ×100 (to the unpruned depth)",
                 "knn_top1": "k-NN top-1 accuracy"}


def _colours(plt, count: int) -> list:
    """Distinct colours for ``count`` strategies (tab10, tab20 beyond ten)."""
    return [plt.get_cmap("tab10" if count <= 10 else "tab20")(i) for i in range(count)]


def _quality_panel(ax, result: dict, metric: str, colours: dict) -> None:
    """Mean error against ratio per (strategy, LLF variant) on a log axis; the std across seeds
    as a band clipped to the floor (a log axis cannot show mean − std ≤ 0)."""
    ratios = result["ratios"]

    def stat(by_ratio: dict, name: str) -> np.ndarray:
        return np.array([by_ratio[f"{r:g}"][metric][name] for r in ratios], dtype=float)

    series = [(ls, marker, strategy, suffix, stat(by_ratio, "mean"), stat(by_ratio, "std")) for key, ls, marker, suffix in VARIANTS
              for strategy, by_ratio in result["tables"].get(key, {}).items()]
    floor, clipped = log_floor([s[4] for s in series]), 0
    for ls, marker, strategy, suffix, mean, std in series:
        colour = colours[strategy]
        clipped += log_series(ax, ratios, mean, floor, ls=ls, marker=marker, ms=4, color=colour, label=strategy + suffix)
        ax.fill_between(ratios, np.maximum(mean - std, floor), np.maximum(mean + std, floor), color=colour, alpha=0.12, lw=0)
    ax.set_yscale("log")
    decade_limits(ax)
    note_floor(ax, floor, clipped)
    ax.set_xlabel("prune ratio η (fraction of tokens removed)")
    ax.set_ylabel(METRIC_TITLES.get(metric, metric))
    ax.grid(alpha=0.3, which="both")


def quality_figure(result: dict):
    """One panel per metric of ``result`` (:func:`pullback_ext.comparison.evaluation.run_quality`): mean
    error (band: ± std across seeds) against ratio for each strategy, log y; prune mode without LLF
    dashed with triangles, full LLF dotted with squares. The legend sits right of the panels."""
    plt = pyplot()
    metrics = METRICS[result["task"]]
    strategies = list(dict.fromkeys(s for key, *_ in VARIANTS for s in result["tables"].get(key, {})))
    colours = dict(zip(strategies, _colours(plt, len(strategies))))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics) + 2, 4.2), squeeze=False, layout="constrained")
    for ax, metric in zip(axes[0], metrics):
        _quality_panel(ax, result, metric, colours)
    outside_legend(fig, axes[0][0])
    fig.suptitle(f"{result['task']} / {result['mode']} at layers {result['layers']} (lower is better)")
    return fig


def plot_quality(result: dict, path: str | os.PathLike) -> Path:
    """:func:`quality_figure` written to ``path``."""
    return save_figure(quality_figure(result), path)
