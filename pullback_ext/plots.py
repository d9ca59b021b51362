"""Figures (matplotlib, Agg) and the axis rules every figure of the package follows.

Rules: a quantity spanning two decades or more, and every error, is drawn on a log axis whose
limits hold at least two decade ticks; a value ≤ 0 there is never drawn at a made-up zero but
clipped to a stated floor (a decade below the smallest positive value), with a hollow ▽ marker and
a note on the panel; images carry a colorbar; legends tell series apart by colour *and*
linestyle/marker and sit outside the data. Each ``*_figure`` builds a figure that ``plot_*``
saves, so the figures can be inspected without writing a file.

Diagnostic figures here: spectrum with cumulative κ_cap, per-token energy heatmaps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from pullback_ext.errors import PullbackError
from pullback_ext.fileio import atomic_path
from pullback_ext.grids import grid_shape

FLOOR_MARKER = dict(marker="v", mfc="none", ls="none", ms=6)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` atomically (temporary file in the same folder, then os.replace)."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight", format=path.suffix.lstrip(".") or "png")
    finally:
        pyplot().close(fig)
    return path


def spans_decades(values, decades: float = 2.0) -> bool:
    """Whether the positive finite ``values`` span at least ``decades`` powers of ten."""
    v = np.asarray(values, dtype=float).ravel()
    v = v[np.isfinite(v) & (v > 0)]
    return v.size > 0 and math.log10(v.max() / v.min()) >= decades


def log_floor(values) -> float:
    """The floor a log axis draws values ≤ 0 at: a decade below the smallest positive finite value
    (1e-12 when there is none)."""
    v = np.asarray(values, dtype=float).ravel()
    v = v[np.isfinite(v) & (v > 0)]
    return float(10 ** math.floor(math.log10(v.min()) - 1)) if v.size else 1e-12


def log_series(ax, x, y, floor: float, **style) -> int:
    """Plot ``y`` against ``x`` on a log y axis, values ≤ ``floor`` drawn at ``floor`` with a hollow
    ▽ in the series' colour; returns how many were clipped. ``style``: Line2D keywords."""
    y = np.asarray(y, dtype=float)
    clipped = y <= floor
    (line,) = ax.plot(x, np.maximum(y, floor), **style)
    if clipped.any():
        ax.plot(np.asarray(x)[clipped], np.full(int(clipped.sum()), floor), color=line.get_color(), **FLOOR_MARKER)
    return int(clipped.sum())


def note_floor(ax, floor: float, clipped: int) -> None:
    """The floor line and the panel note saying how many values ≤ 0 are drawn at it (none:
    nothing); the y axis then reaches a little below the floor, so that its ▽ markers show whole.
    Call after :func:`decade_limits`."""
    if clipped:
        low, high = ax.get_ylim()
        ax.set_ylim(min(low, floor / 2), high)
        ax.axhline(floor, color="gray", ls=":", lw=0.8)
        ax.annotate(f"▽ {clipped} value{'s' if clipped > 1 else ''} ≤ {floor:.0e} drawn at {floor:.0e}",
                    xy=(0.01, 0.01), xycoords="axes fraction", fontsize=7, color="dimgray", va="bottom")


def decade_limits(ax, which: str = "y") -> None:
    """Widen a log axis to whole decades, so that at least two labelled decade ticks lie inside."""
    get, set_ = (ax.get_ylim, ax.set_ylim) if which == "y" else (ax.get_xlim, ax.set_xlim)
    low, high = sorted(get())
    low_exp, high_exp = math.floor(math.log10(low) + 1e-9), math.ceil(math.log10(high) - 1e-9)
    if high_exp <= low_exp:
        high_exp = low_exp + 1
    inverted = get()[0] > get()[1]
    limits = (10.0 ** low_exp, 10.0 ** high_exp)
    set_(*(limits[::-1] if inverted else limits))


def outside_legend(fig, ax, **kwargs) -> None:
    """One figure legend right of the panels (outside the data), from ``ax``'s labelled series."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=7, **kwargs)


def spectrum_figure(sigmas: Sequence[Tensor], traces: Sequence[float], title: str = "", kappa_threshold: float = 0.9):
    """Left axis: σ_j² of each image (log scale). Right axis: cumulative κ_cap(k) = Σ_{j≤k} σ_j² / T,
    mean ± std over images, with the low-rank threshold; T = tr(JᵀJ) = ‖J‖_F², the probe's total
    sensitivity.

    sigmas: per image σ[r]; traces: per image T.
    """
    if len(sigmas) == 0 or len(sigmas) != len(traces):
        raise PullbackError(f"sigmas, traces: expected the same non-zero number of images, got {len(sigmas)} and {len(traces)}")
    fig, ax = pyplot().subplots(figsize=(6.5, 4), layout="constrained")
    r = min(len(s) for s in sigmas)
    k = np.arange(1, r + 1)
    energies = [(s[:r].double() ** 2).numpy() for s in sigmas]
    floor, clipped = log_floor(energies), 0
    for i, lam in enumerate(energies):
        clipped += log_series(ax, k, lam, floor, color="tab:blue", alpha=0.35, lw=1, marker=".", label="σ_j² per image" if i == 0 else None)
    ax.set_yscale("log")
    decade_limits(ax)
    note_floor(ax, floor, clipped)
    ax.set_xlabel("mode j (singular directions of the Jacobian J, largest first)")
    ax.set_ylabel("σ_j² (squared singular value of J)", color="tab:blue")
    curves = torch.stack([torch.cumsum(torch.from_numpy(lam), 0) / t if t > 0 else torch.zeros(r, dtype=torch.float64)
                          for lam, t in zip(energies, traces)])
    mean = curves.mean(0)
    std = curves.std(0) if len(sigmas) > 1 else torch.zeros_like(mean)
    twin = ax.twinx()
    twin.plot(k, mean.numpy(), color="tab:red", lw=2, ls="-", label="κ_cap(k), mean ± std over images")
    twin.fill_between(k, (mean - std).numpy(), (mean + std).numpy(), color="tab:red", alpha=0.2)
    twin.axhline(kappa_threshold, color="gray", ls="--", lw=1, label=f"low-rank threshold κ = {kappa_threshold:g}")
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("cumulative κ_cap(k) = Σ_{j≤k} σ_j² / T", color="tab:red")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    fig.legend(handles, [h.get_label() for h in handles], loc="outside lower center", ncols=3, fontsize=7)
    ax.set_title((title or f"spectrum and captured energy ({len(sigmas)} images)") + "\nT = tr(JᵀJ) = ‖J‖²_F, the total sensitivity",
                 fontsize=9)
    return fig


def plot_spectrum(sigmas: Sequence[Tensor], traces: Sequence[float], path: str | Path, title: str = "",
                  kappa_threshold: float = 0.9) -> Path:
    """:func:`spectrum_figure` written to ``path``."""
    return save_figure(spectrum_figure(sigmas, traces, title, kappa_threshold), path)


def colour_range(values: Tensor) -> tuple[float, float]:
    """(vmin, vmax) of a heatmap; a uniform map gets a small width so that its colorbar is readable."""
    low, high = float(values.min()), float(values.max())
    if high - low <= 1e-9 * max(abs(high), 1e-300):
        low, high = low - 0.5 * max(abs(low), 1.0) * 1e-3, high + 0.5 * max(abs(high), 1.0) * 1e-3
    return low, high


def token_energy_figure(energies: Sequence[Tensor], num_prefix_tokens: int, grid_size: Optional[Sequence[int]] = None,
                        titles: Optional[Sequence[str]] = None, max_images: int = 8):
    """Heatmaps of the per-token energy e_t over the patch grid, one panel per image (first
    ``max_images``), each with its colorbar below it (beside it, it ran into the next panel); each
    title gives the share of Σ_t e_t held by the prefix tokens (CLS, registers), which the grid
    does not show, and the figure says so.

    energies: per image e[N] with the ``num_prefix_tokens`` CLS/register tokens first.
    """
    if len(energies) == 0:
        raise PullbackError("energies: expected at least one image, got none")
    shown = list(energies)[:max_images]
    h, w = grid_shape(shown[0].numel() - num_prefix_tokens, grid_size)
    cols = min(4, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig, axes = pyplot().subplots(rows, cols, figsize=(3 * cols, 3.4 * rows + 0.5), squeeze=False, layout="constrained")
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i >= len(shown):
            continue
        e = shown[i].double()
        total = float(e.sum())
        prefix_share = float(e[:num_prefix_tokens].sum()) / total if total > 0 else 0.0
        patch = e[num_prefix_tokens:]
        low, high = colour_range(patch)
        im = ax.imshow(patch.reshape(h, w).numpy(), cmap="magma", vmin=low, vmax=high)
        fig.colorbar(im, ax=ax, location="bottom", shrink=0.8, label="e_t", format="%.2g")
        name = titles[i] if titles is not None else f"image {i}"
        ax.set_title(f"{name}\nprefix share {prefix_share:.2f}", fontsize=8)
    fig.suptitle("per-token sensitivity energy e_t over the patch grid\n"
                 "prefix share: the part of Σ_t e_t on the prefix tokens (CLS, registers), not drawn", fontsize=9)
    return fig


def plot_token_energy(energies: Sequence[Tensor], num_prefix_tokens: int, path: str | Path,
                      grid_size: Optional[Sequence[int]] = None, titles: Optional[Sequence[str]] = None,
                      max_images: int = 8) -> Path:
    """:func:`token_energy_figure` written to ``path``."""
    return save_figure(token_energy_figure(energies, num_prefix_tokens, grid_size, titles, max_images), path)
