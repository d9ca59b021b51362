"""The diagnostic stage of ``pullback demo``: Table-1-style regimes of the demo model.

Runs ``pullback_ext.diagnose`` at three probe layers for the CLS embedding and the depth decoder,
prints the table, and plots the spectra and the imp* heatmaps over the images.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pullback_ext.demo.stages import DemoInputs, StageResult
from pullback_ext.plots import colour_range, decade_limits, log_floor, log_series, note_floor, pyplot, save_figure

NAME = "diagnostic"
PROBE_LAYERS = (1, 3, 6)
PLAN = {True: "κ_cap, CV and regime of the CLS and depth probes at blocks 1, 3, 6 on 1 scene (no SLQ)",
        False: "κ_cap, CV, r_eff and regime of the CLS and depth probes at blocks 1, 3, 6 on 2 scenes"}
EXPECTED_S = {True: 10, False: 30}


@dataclass(frozen=True)
class DiagnosticSettings:
    """What the stage computes. Every tangent pass costs about one forward of the remaining
    blocks (P = 197·192), so both runs use fewer images, sketch columns and SLQ probes than the
    library defaults; the quick run skips r_eff^SLQ."""

    num_images: int
    depth_output_size: int
    oversample: int
    power: int
    probes: int
    slq_steps: int
    rank: int = 20
    decoders: tuple[str, ...] = ("embedding", "depth")

    @classmethod
    def for_run(cls, quick: bool) -> "DiagnosticSettings":
        if quick:
            return cls(num_images=1, depth_output_size=8, oversample=2, power=1, probes=8, slq_steps=0)
        return cls(num_images=2, depth_output_size=16, oversample=5, power=2, probes=10, slq_steps=10)


DECODER_LABELS = {"embedding": "CLS embedding", "depth": "DPT depth", "cls": "CLS logits"}


def _patch_cv(token_energy: torch.Tensor, num_prefix_tokens: int) -> float:
    """CV of e_t over the patch tokens only. For a CLS decoder the CLS token's own energy can
    dominate the all-token CV (≈ sqrt(N-1) when it holds everything); this shows the spatial part."""
    e = token_energy[num_prefix_tokens:].double()
    mean = float(e.mean())
    return float(e.std(unbiased=False)) / mean if mean > 0 else 0.0


def _format_table(rows: list[dict]) -> str:
    header = (f"{'decoder':<14} {'layer':>5} {'M':>5} {'kappa_cap':>15} {'CV':>13} {'CV patches':>10} "
              f"{'r_eff_trunc':>11} {'r_eff_SLQ':>10}  regime")
    lines = [header, "-" * len(header)]
    for row in rows:
        slq = f"{row['r_eff_slq']:.1f}" if row["r_eff_slq"] is not None else "-"
        lines.append(
            f"{DECODER_LABELS[row['decoder']]:<14} {row['layer']:>5} {row['M']:>5} "
            f"{row['kappa_cap']:>7.3f} ± {row['kappa_cap_std']:<5.3f} {row['cv']:>5.2f} ± {row['cv_std']:<5.2f} "
            f"{row['cv_patches']:>10.2f} "
            f"{row['r_eff_trunc']:>11.1f} {slq:>10}  ({row['regime']}) {row['regime_name']}"
        )
    return "\n".join(lines)


LAYER_STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."))


def spectra_figure(energies: dict):
    """One panel per decoder: the mean captured-energy spectrum σ_j² / T over the images, one line
    per probe layer (marker and linestyle per layer), log y with whole decades.

    energies: {decoder: {layer: tensor [r] of mean σ_j² / T}}.
    """
    fig, axes = pyplot().subplots(1, len(energies), figsize=(4.4 * len(energies), 3.8), squeeze=False, layout="constrained")
    for ax, (decoder, by_layer) in zip(axes[0], energies.items()):
        floor, clipped = log_floor([e.numpy() for e in by_layer.values()]), 0
        for (layer, e), (marker, ls) in zip(by_layer.items(), LAYER_STYLES * len(by_layer)):
            clipped += log_series(ax, np.arange(1, e.numel() + 1), e.numpy(), floor, marker=marker, ls=ls, ms=3, label=f"layer {layer}")
        ax.set_yscale("log")
        decade_limits(ax)
        note_floor(ax, floor, clipped)
        ax.set_title(f"{DECODER_LABELS[decoder]}", fontsize=9)
        ax.set_xlabel("mode j (largest first)")
        ax.set_ylabel("σ_j² / T (share of the total sensitivity)")
        ax.legend(fontsize=8, loc="best")
    fig.suptitle("captured-energy spectrum; T = tr(JᵀJ) = ‖J‖²_F = Σ_j σ_j² over all modes", fontsize=9)
    return fig


def importance_figure(images: torch.Tensor, maps: dict):
    """The images, then one column per (decoder, layer) of imp*(t) over the patch grid, with a
    colorbar per column (the column shares its colour scale, so images compare within a column).

    images: [n, 3, H, W] in [0, 1]; maps: {(decoder, layer): tensor [n, h, w]}.
    """
    from matplotlib.colors import Normalize
    from matplotlib.ticker import MaxNLocator

    n = images.shape[0]
    fig, axes = pyplot().subplots(n, len(maps) + 1, figsize=(1.9 * (len(maps) + 1), 1.9 * n + 0.9), squeeze=False,
                                  layout="constrained")
    for i in range(n):
        axes[i, 0].imshow(images[i].permute(1, 2, 0).clamp(0, 1).numpy())
    for j, ((decoder, layer), imp) in enumerate(maps.items(), start=1):
        norm = Normalize(*colour_range(imp))
        for i in range(n):
            im = axes[i, j].imshow(imp[i].numpy(), cmap="magma", norm=norm)
        axes[0, j].set_title(f"{DECODER_LABELS.get(decoder, decoder)}\nblock {layer}", fontsize=8)
        fig.colorbar(im, ax=axes[:, j].tolist(), location="bottom", shrink=0.9, label="imp*(t)", ticks=MaxNLocator(3), format="%.2g")
    axes[0, 0].set_title("image", fontsize=8)
    for ax in axes.flat:
        ax.axis("off")
    fig.suptitle("imp*(t) = sqrt(e_t) over patch tokens", fontsize=9)
    return fig


def _write_plots(results: dict, images: torch.Tensor, grid: int, out_dir: Path) -> None:
    """spectra.png and importance.png of the diagnoses ``results`` {decoder: {layer: diagnosis}}."""
    energies = {decoder: {layer: torch.stack([d.sigma**2 / d.trace for d in diag.images]).mean(0) for layer, diag in by_layer.items()}
                for decoder, by_layer in results.items()}
    save_figure(spectra_figure(energies), out_dir / "spectra.png")
    maps = {(decoder, layer): torch.stack([d.importance[-grid * grid:].reshape(grid, grid) for d in diag.images])
            for decoder, by_layer in results.items() for layer, diag in by_layer.items()}
    save_figure(importance_figure(images, maps), out_dir / "importance.png")


def run_demo_stage(inputs: DemoInputs) -> StageResult:
    """Diagnose the demo model on the held-out scenes' images; writes spectra.png and importance.png.

    Reports {"settings", "table": [row per (decoder, layer)], "per_image": {...}, "plots"}.
    """
    from pullback_ext.progress import progress_bar

    from pullback_ext.diagnostics import DiagnoseConfig, diagnose
    from pullback_ext.embedded.probes import demo_probe

    model, scenes = inputs.model, inputs.scenes
    settings = DiagnosticSettings.for_run(inputs.quick)
    config = DiagnoseConfig(rank=settings.rank, oversample=settings.oversample, power=settings.power,
                            probes=settings.probes, slq_steps=settings.slq_steps, seed=0)
    images = scenes["images"][: settings.num_images]
    grid = int(round((model.backbone.patch_embed.num_patches) ** 0.5))
    results: dict[str, dict[int, object]] = {}
    rows = []
    jobs = [(d, layer) for d in settings.decoders for layer in PROBE_LAYERS]
    for decoder, layer in progress_bar(jobs, desc="diagnostic", unit="probe"):
        started = time.time()
        probe = demo_probe(model, layer, decoder, output_size=settings.depth_output_size if decoder == "depth" else None)
        with torch.no_grad():
            F = probe.features(images)
        diag = diagnose(probe, F, config)
        results.setdefault(decoder, {})[layer] = diag
        agg = diag.aggregate
        rows.append({
            "decoder": decoder, "layer": layer, "M": diag.images[0].M, "P": diag.images[0].P,
            "kappa_cap": agg["kappa_cap"]["mean"], "kappa_cap_std": agg["kappa_cap"]["std"],
            "cv": agg["cv"]["mean"], "cv_std": agg["cv"]["std"],
            "cv_patches": sum(_patch_cv(d.token_energy, probe.num_prefix_tokens) for d in diag.images) / len(diag.images),
            "r_eff_trunc": agg["r_eff_trunc"]["mean"],
            "r_eff_slq": agg["r_eff_slq"]["mean"] if "r_eff_slq" in agg else None,
            "regime": diag.regime, "regime_name": diag.to_dict()["regime_name"], "recommended": diag.method,
            "seconds": time.time() - started,
        })
    table = _format_table(rows)
    print("\nTractability diagnostic (mean ± std over images; regime from κ_cap and the all-token CV):\n" + table, flush=True)
    out_dir = Path(inputs.out_dir)
    _write_plots(results, images, grid, out_dir)
    per_image = {
        f"{decoder}/L{layer}": diag.to_dict()["images"] for decoder in results for layer, diag in results[decoder].items()
    }
    return StageResult({
        "settings": {**settings.__dict__, "layers": list(PROBE_LAYERS), "num_images": int(images.shape[0])},
        "table": rows,
        "table_text": table,
        "per_image": per_image,
        "plots": ["spectra.png", "importance.png"],
    })
