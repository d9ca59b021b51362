"""The studies' figures (matplotlib, Agg): quantities against depth with the regime bands shaded,
layer × k and criterion × layer heatmaps with colorbars. Axes that span more than a decade are
logarithmic."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from pullback_ext.diagnostics import REGIMES
from pullback_ext.plots import save_figure

REGIME_COLOURS = {"i": "tab:red", "ii": "tab:green", "iii": "tab:orange", "iv": "tab:blue", "v": "tab:purple"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _spans_decades(values: Sequence) -> bool:
    finite = [v for v in values if v is not None and v > 0]
    return len(finite) > 1 and max(finite) / min(finite) > 10


def _shade_regimes(ax, layers: Sequence[int], regimes: Sequence[str]) -> None:
    for layer, regime in zip(layers, regimes):
        ax.axvspan(layer - 0.5, layer + 0.5, color=REGIME_COLOURS[regime], alpha=0.12, lw=0)


def plot_diagnose_study(result: dict, path: str | Path) -> Path:
    """One row per decoder: κ_cap(r) for each r, CV, r_eff (truncated and SLQ), r₀.₉₀ against the
    layer, the background of each layer coloured by its regime."""
    plt = _pyplot()
    layers, summary = result["layers"], result["summary"]
    fig, axes = plt.subplots(len(summary), 4, figsize=(16, 3.2 * len(summary)), squeeze=False)
    for row, (decoder, s) in zip(axes, summary.items()):
        for r, values in s["kappa_at"].items():
            row[0].plot(layers, values, marker="o", label=f"r = {r}")
        row[0].set(ylim=(0, 1.05), ylabel="κ_cap(r) (share of ‖J‖²_F)")
        row[0].legend(fontsize=7)
        panels = ((row[1], {"cv": "CV"}, "CV of e_t (std/mean, unitless)"),
                  (row[2], {"r_eff_trunc": "r_eff^trunc", "r_eff_slq": "r_eff^SLQ"}, "effective rank (modes)"),
                  (row[3], {"r90": "r₀.₉₀"}, "r₀.₉₀ (modes)"))
        for ax, names, label in panels:
            shown = []
            for name, text in names.items():
                values = s[name]
                if any(v is not None for v in values):
                    ax.plot(layers, [float("nan") if v is None else v for v in values], marker="o", label=text)
                    shown += values
            if _spans_decades(shown):
                ax.set_yscale("log")
            ax.set_ylabel(label)
            if len(names) > 1:
                ax.legend(fontsize=7)
        for ax in row:
            _shade_regimes(ax, layers, s["regime"])
            ax.set_xlabel("layer ℓ (0-based block)")
            ax.set_xticks(layers)
        row[0].set_title(f"decoder {decoder}", loc="left", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.3) for c in REGIME_COLOURS.values()]
    fig.legend(handles, [f"({k}) {REGIMES[k][0]}" for k in REGIME_COLOURS], loc="lower center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return save_figure(fig, path)


def plot_subspace_study(result: dict, path: str | Path) -> Path:
    """Per model a layer × k heatmap of the probe's quality with the features projected onto the
    top-k subspace, side by side; last, the unprojected and the k = 1 quality against the layer."""
    plt = _pyplot()
    models = result["models"]
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(4.5 * (len(models) + 1), 3.8), squeeze=False)
    for ax, (name, study) in zip(axes[0], models.items()):
        layers = study["layers"]
        ks = study["units"][str(layers[0])]["ks"]
        grid = [[study["units"][str(layer)]["curves"]["subspace"][i] for layer in layers] for i in range(len(ks))]
        image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=min(0.0, min(map(min, grid))), vmax=1.0)
        ax.set(xticks=range(len(layers)), xticklabels=layers, yticks=range(len(ks)), yticklabels=ks,
               xlabel="layer ℓ (0-based block)", ylabel="k (subspace dimensions)", title=f"{name}: top-k subspace")
        fig.colorbar(image, ax=ax, label=f"probe {study['quality_name']}")
    ax = axes[0][-1]
    for name, study in models.items():
        line = ax.plot(study["layers"], study["summary"]["quality"], marker="o", label=f"{name}: unprojected")[0]
        ax.plot(study["layers"], study["summary"]["subspace_k1"], marker="x", ls="--", color=line.get_color(), label=f"{name}: top-1")
    ax.set(xlabel="layer ℓ (0-based block)", ylabel="probe quality (R², unitless)", title="quality against depth")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_criteria_study(result: dict, path: str | Path) -> Path:
    """First row: per task a criterion × layer heatmap of its primary error against the unpruned
    model (log colour scale where it spans decades); second row (with recovery): per dense task its
    error against α per criterion."""
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    summary = result["summary"]
    tasks, recovered = list(summary["tasks"]), summary.get("recovery", {})
    rows, cols = 1 + bool(recovered), max(len(tasks), len(recovered))
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax in [*axes[0][len(tasks):], *(axes[1][len(recovered):] if recovered else ())]:
        ax.set_axis_off()
    criteria, layers = result["criteria"], summary["layers"]
    for ax, task in zip(axes[0], tasks):
        s = summary["tasks"][task]
        flat = [v for row in s["matrix"] for v in row]
        norm = LogNorm(vmin=max(min(v for v in flat if v > 0), 1e-6), vmax=max(flat)) if _spans_decades(flat) else None
        image = ax.imshow(s["matrix"], aspect="auto", cmap="magma_r", norm=norm)
        ax.set(xticks=range(len(layers)), xticklabels=layers, yticks=range(len(criteria)), yticklabels=criteria,
               xlabel="layer ℓ (pruned after block ℓ)", title=f"{task}, ratio {result['settings']['ratio']:g}")
        fig.colorbar(image, ax=ax, label=s["metric"].replace("_x100", " ×100"))
    for ax, (task, r) in zip(axes[-1], recovered.items()):
        for c, e in r["criteria"].items():
            ax.plot([float(a) for a in e["mean"]], list(e["mean"].values()), marker="o", label=c)
        if _spans_decades([v for e in r["criteria"].values() for v in e["mean"].values()]):
            ax.set_yscale("log")
        ax.set(xlabel="α (1: frozen copy, 0: kept-neighbour mean)", ylabel=f"{r['metric'].replace('_x100', ' ×100')}, mean over layers",
               title=f"{task}: recovery endpoints")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)
