"""Evaluation outputs: JSON, markdown table and the quality-against-ratio plot, written atomically."""

from __future__ import annotations

import os
from pathlib import Path

from pullback_ext.fileio import atomic_write_json, atomic_write_text
from pullback_ext.prune.evaluation import METRICS


def write_json(obj: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    atomic_write_json(path, obj)
    return path


def write_text(text: str, path: str | os.PathLike) -> Path:
    path = Path(path)
    atomic_write_text(path, text)
    return path


def plot_quality(result: dict, path: str | os.PathLike) -> Path:
    """One panel per metric: mean error (± std across seeds) against ratio for each strategy;
    dashed lines are prune mode without LLF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = METRICS[result["task"]]
    ratios = result["ratios"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.2), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, metric in zip(axes[0], metrics):
        for llf_key, style, suffix in (("merge", "-", ""), ("llf", "-", ""), ("llf_full", ":", " (full LLF)"), ("no_llf", "--", " (no LLF)")):
            for i, (strategy, cells) in enumerate(result["tables"].get(llf_key, {}).items()):
                means = [cells[f"{r:g}"][metric]["mean"] for r in ratios]
                stds = [cells[f"{r:g}"][metric]["std"] for r in ratios]
                label = strategy + suffix
                ax.errorbar(ratios, means, yerr=stds, linestyle=style, marker="o", ms=3, capsize=2,
                            color=colours[i % len(colours)], label=label)
        ax.set_xlabel("prune ratio η")
        ax.set_ylabel(metric.replace("_x100", " ×100"))
        ax.set_yscale("symlog", linthresh=1e-2)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{result['task']} / {result['mode']} at layers {result['layers']}")
    fig.tight_layout()
    from pullback_ext.plots import save_figure

    return save_figure(fig, path)
