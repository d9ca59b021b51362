"""Diagnostic figures (matplotlib, Agg): spectrum with cumulative κ_cap, per-token energy heatmaps."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor

from pullback_ext.fileio import atomic_path
from pullback_ext.errors import PullbackError


def _pyplot():
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
        _pyplot().close(fig)
    return path


def plot_spectrum(
    sigmas: Sequence[Tensor],
    traces: Sequence[float],
    path: str | Path,
    title: str = "",
    kappa_threshold: float = 0.9,
) -> Path:
    """Left axis: σ_j² of each image (log scale). Right axis: cumulative κ_cap(k) = Σ_{j≤k} σ_j² / T,
    mean ± std over images, with the low-rank threshold.

    sigmas: per image σ[r]; traces: per image T.
    """
    if len(sigmas) == 0 or len(sigmas) != len(traces):
        raise PullbackError(f"sigmas, traces: expected the same non-zero number of images, got {len(sigmas)} and {len(traces)}")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    r = min(len(s) for s in sigmas)
    k = torch.arange(1, r + 1)
    for s in sigmas:
        ax.semilogy(k, (s[:r].double() ** 2).clamp_min(1e-300), color="tab:blue", alpha=0.25, lw=1)
    lam = torch.cat([s[:r].double() ** 2 for s in sigmas])
    low, high = float(lam.min()), float(lam.max())
    if low > 0 and high <= low * (1 + 1e-9):  # flat spectrum: give the log axis a height
        ax.set_ylim(low / 2, high * 2)
    ax.set_xlabel("mode j")
    ax.set_ylabel("σ_j²", color="tab:blue")
    curves = torch.stack([torch.cumsum(s[:r].double() ** 2, 0) / t if t > 0 else torch.zeros(r, dtype=torch.float64) for s, t in zip(sigmas, traces)])
    mean = curves.mean(0)
    std = curves.std(0) if len(sigmas) > 1 else torch.zeros_like(mean)
    twin = ax.twinx()
    twin.plot(k, mean, color="tab:red", lw=2, label="κ_cap(k)")
    twin.fill_between(k.numpy(), (mean - std).numpy(), (mean + std).numpy(), color="tab:red", alpha=0.2)
    twin.axhline(kappa_threshold, color="gray", ls="--", lw=1)
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("cumulative κ_cap", color="tab:red")
    ax.set_title(title or f"spectrum and captured energy ({len(sigmas)} images)")
    return save_figure(fig, path)


def grid_shape(num_patch_tokens: int, grid_size: Optional[Sequence[int]] = None) -> tuple[int, int]:
    """(h, w) of the patch grid: ``grid_size`` if given, else the square root of the token count."""
    if grid_size is not None:
        h, w = int(grid_size[0]), int(grid_size[1])
    else:
        h = w = int(round(math.sqrt(num_patch_tokens)))
    if h * w != num_patch_tokens:
        raise PullbackError(f"grid_size: {num_patch_tokens} patch tokens do not fill a {h}×{w} grid")
    return h, w


def plot_token_energy(
    energies: Sequence[Tensor],
    num_prefix_tokens: int,
    path: str | Path,
    grid_size: Optional[Sequence[int]] = None,
    titles: Optional[Sequence[str]] = None,
    max_images: int = 8,
) -> Path:
    """Heatmaps of the per-token energy e_t over the patch grid, one panel per image (first
    ``max_images``); the prefix tokens' share of the energy is given in each title.

    energies: per image e[N] with the ``num_prefix_tokens`` CLS/register tokens first.
    """
    if len(energies) == 0:
        raise PullbackError("energies: expected at least one image, got none")
    plt = _pyplot()
    shown = list(energies)[:max_images]
    h, w = grid_shape(shown[0].numel() - num_prefix_tokens, grid_size)
    cols = min(4, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i >= len(shown):
            continue
        e = shown[i].double()
        total = float(e.sum())
        prefix_share = float(e[:num_prefix_tokens].sum()) / total if total > 0 else 0.0
        patch = e[num_prefix_tokens:]
        low, high = float(patch.min()), float(patch.max())
        if high - low <= 1e-9 * max(abs(high), 1e-300):  # uniform energy: give the colour scale a width
            low, high = low - 0.5 * max(abs(low), 1.0) * 1e-3, high + 0.5 * max(abs(high), 1.0) * 1e-3
        im = ax.imshow(patch.reshape(h, w).numpy(), cmap="magma", vmin=low, vmax=high)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        name = titles[i] if titles is not None else f"image {i}"
        ax.set_title(f"{name}\nprefix share {prefix_share:.2f}", fontsize=8)
    fig.suptitle("per-token sensitivity energy e_t")
    return save_figure(fig, path)
