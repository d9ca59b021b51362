"""One ``pullback train`` run: probe, images, targets, model, training loop, held-out evaluation."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from pullback_ext.errors import PullbackError
from pullback_ext.fileio import atomic_write_json
from pullback_ext.metric.probe_spec import ProbeSpec, build_probe, features
from pullback_ext.metric.targets import EXACT_MAX_SIDE, TargetCache, TargetConfig, compute_targets
from pullback_ext.metric.training import TrainConfig
from pullback_ext.plots import decade_limits, log_floor, log_series, note_floor, pyplot, save_figure
from pullback_ext.sources.image_sets import ImageSet, ImageSource

SHARD_SIZE = 32
HIDDEN, HEADS = 256, 4  # the SPN's and the VAE's width and heads unless given (a head's: metric.head_size)


def reference_targets(probe, rank: int, power: int, seed: int, block_norms: bool = False) -> TargetConfig:
    """The most accurate targets affordable for evaluation: exact when min(M, P) allows, else a
    randomized SVD with at least 4 power rounds."""
    M, P = probe.output_dim, probe.num_tokens * probe.dim
    if min(M, P) <= EXACT_MAX_SIDE:
        return TargetConfig(mode="exact", rank=rank, seed=seed, block_norms=block_norms)
    return TargetConfig(mode="randnla", rank=rank, power=max(power, 4), seed=seed, block_norms=block_norms)


def training_figure(rows: list[dict], rho: list[float] | None = None):
    """The training loss per logged step (``rows``: metrics.jsonl records with "step" and "loss"), log y;
    with ``rho``, a histogram of the held-out per-image Spearman ρ next to it."""
    panels = 2 if rho else 1
    fig, axes = pyplot().subplots(1, panels, figsize=(4.8 * panels, 3.6), squeeze=False, layout="constrained")
    ax = axes[0][0]
    loss = [r["loss"] for r in rows]
    floor = log_floor(loss)
    clipped = log_series(ax, [r["step"] for r in rows], loss, floor, marker="." if len(rows) < 30 else None)
    ax.set_yscale("log")
    decade_limits(ax)
    note_floor(ax, floor, clipped)
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("training loss")
    if rho:
        axes[0][1].hist(rho, bins=20)
        axes[0][1].set_xlabel("held-out Spearman ρ per image")
        axes[0][1].set_ylabel("images")
    return fig


def plot_training(metrics_file: Path, out_file: Path, rho: list[float] | None = None) -> None:
    """:func:`training_figure` of ``metrics_file`` (metrics.jsonl) written to ``out_file``."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    save_figure(training_figure(rows, rho), out_file)


@dataclass(frozen=True)
class TrainingRunConfig:
    """Everything one run needs. ``kind``: spn | head | vae; ``probe``: what is trained on;
    ``images``: training images (``num_images``) and then held-out ones (``num_heldout``), or the
    held-out ones from the start of ``eval_images`` when given;
    ``out``: the output folder; ``train``: the optimisation (its ``seed`` seeds everything).

    Targets (spn, head): ``targets`` randnla | exact at ``rank`` (``power``, ``oversample``),
    cached in ``cache`` (default out/targets) unless ``on_the_fly`` (spn). Head: ``target`` imp |
    block-norm | spn:DIR, ranking-loss weight ``w_rank``; spn: ``w_order``, floor ``eps``.
    Models: ``hidden`` width, ``heads``, head ``mlp_hidden`` (None: spn and vae :data:`HIDDEN` and
    :data:`HEADS`; a head sized to its backbone, :func:`~pullback_ext.metric.head_size.choose`);
    vae ``latent_dim``, ``beta`` and ``diagnose_images`` diagnosed at the features and at the latent afterwards.
    """

    kind: str
    probe: ProbeSpec
    images: ImageSource
    out: Path
    train: TrainConfig
    num_images: int = 256
    num_heldout: int = 32
    dtype: str = "float32"
    rank: int = 20
    targets: str = "randnla"
    power: int = 1
    oversample: int = 10
    on_the_fly: bool = False
    cache: Optional[Path] = None
    target: str = "imp"
    w_rank: float = 0.5
    w_order: float = 0.0
    hidden: Optional[int] = None
    heads: Optional[int] = None
    mlp_hidden: Optional[int] = None
    eps: float = 1e-3
    latent_dim: int = 32
    beta: float = 1e-3
    diagnose_images: int = 2
    eval_images: Optional[ImageSource] = None
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("spn", "head", "vae"):
            raise PullbackError(f"kind: expected spn, head or vae, got {self.kind!r}")
        if self.dtype not in ("float32", "float64"):
            raise PullbackError(f"dtype: expected float32 or float64, got {self.dtype!r}")


class TrainingRun:
    def __init__(self, config: TrainingRunConfig, info) -> None:
        self.config, self.spec, self.info = config, config.probe, info
        self.out = Path(config.out)
        self.dtype = torch.float64 if config.dtype == "float64" else torch.float32

    def _barrier(self) -> None:
        if self.info.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def _targets(self, probe, source: ImageSet, config: TargetConfig) -> dict[str, Tensor]:
        """Cached targets of the training images, shards split over ranks."""
        c = self.config
        cache = TargetCache(c.cache or self.out / "targets")
        described = {"probe": self.spec.to_dict(), "images": source.describe(), "dtype": c.dtype}
        fetch = lambda s, e: features(probe, source, s, e)
        progress = c.progress and self.info.is_main
        if self.info.world_size == 1:
            return cache.build(probe, fetch, len(source), config, described, SHARD_SIZE, progress)
        cache.build(probe, fetch, len(source), config, described, SHARD_SIZE, progress, self.info.rank, self.info.world_size)
        self._barrier()
        if self.info.is_main:
            cache.write_manifest(len(source), config, described, SHARD_SIZE)
        self._barrier()
        return cache.load(config, described)

    def _vae(self, probe, train_src: ImageSet) -> tuple[dict, torch.nn.Module, Any, dict]:
        """(data, model, task, config entries) of a feature VAE."""
        from pullback_ext.metric.tasks import VAETask
        from pullback_ext.metric.vae import FeatureVAE

        c = self.config
        data = {"features": features(probe, train_src, 0, len(train_src)).F}
        model = FeatureVAE(probe.dim, c.latent_dim, HIDDEN if c.hidden is None else c.hidden).to(self.dtype)
        model.fit_normalization(data["features"])
        return data, model, VAETask(beta=c.beta, seed=c.train.seed), {"beta": c.beta}

    def _spn(self, probe, train_src: ImageSet, config: TargetConfig) -> tuple[dict, torch.nn.Module, Any, dict]:
        """(data, model, task, config entries) of an SPN: cached targets, or a fresh sketch every step."""
        from pullback_ext.metric.spn import SPN
        from pullback_ext.metric.tasks import SPNTask

        c = self.config
        extra: dict[str, Any] = {"targets": asdict(config), "w_order": c.w_order}
        if c.on_the_fly:
            if probe.context_keys:
                raise PullbackError("--on-the-fly: this probe reads per-image decoder context besides F; use cached targets")
            data = {"features": features(probe, train_src, 0, len(train_src)).F}
            task = SPNTask(config, probe=probe, w_order=c.w_order)
            extra["targets"]["on_the_fly"] = True
        else:
            data = self._targets(probe, train_src, config)
            task = SPNTask(config, w_order=c.w_order)
        model = SPN(probe.dim, c.rank, HIDDEN if c.hidden is None else c.hidden, HEADS if c.heads is None else c.heads,
                    c.eps).to(self.dtype)
        sample = data if "sigma" in data else compute_targets(probe, data["features"][:8], config)
        model.set_energy_scale(sample["sigma"][:, : min(c.rank, sample["V"].shape[-1])] ** 2)
        return data, model, task, extra

    def _head(self, probe, train_src: ImageSet, config: TargetConfig) -> tuple[dict, torch.nn.Module, Any, dict]:
        """(data, model, task, config entries) of an importance head on cached targets."""
        from pullback_ext.metric import head_size
        from pullback_ext.metric.head import ImportanceHead, parameter_count
        from pullback_ext.metric.tasks import HeadTask

        c = self.config
        size = head_size.choose(probe, c.hidden, c.heads, c.mlp_hidden)  # checked before the targets are computed
        data = self._targets(probe, train_src, config)
        task = HeadTask(target="importance", w_rank=c.w_rank)
        model = ImportanceHead(probe.dim, size.hidden, size.heads, size.mlp_hidden).to(self.dtype)
        self.head_size = size.record(parameter_count(model))
        if self.info.is_main:
            share = self.head_size["flop_share"]
            print(f"ImportanceHead(dim={probe.dim}, hidden={size.hidden}, heads={size.heads}, mlp_hidden={size.mlp_hidden}): "
                  f"{parameter_count(model):,} parameters" + ("" if share is None else f", {share:.2%} of the backbone's FLOPs")
                  + (f" (sized: {', '.join(size.sized)})" if size.sized else ""), flush=True)
        task.target = "block_norm" if c.target == "block-norm" else "importance"
        if c.target.startswith("spn:"):
            data["importance"] = self._distilled(c.target[4:], data["features"])
        model.set_score_offset(data[task.target])
        return data, model, task, {"targets": asdict(config), "target": c.target, "w_rank": c.w_rank, "head_size": self.head_size}

    def run(self) -> dict[str, Any]:
        from pullback_ext.metric.head import parameter_count
        from pullback_ext.metric.training import METRICS_FILE, fit

        c = self.config
        torch.manual_seed(c.train.seed)
        probe, preprocess = build_probe(self.spec, self.dtype)
        train_src = c.images.training(preprocess, c.num_images)
        held_src = (c.images.heldout(preprocess, c.num_heldout, after=c.num_images) if c.eval_images is None
                    else c.eval_images.heldout(preprocess, c.num_heldout))
        P = probe.num_tokens * probe.dim
        if c.rank > P:
            raise PullbackError(f"--rank: expected r <= P = N·D = {P}, got {c.rank}")
        torch.manual_seed(c.train.seed)  # the model's initialisation must not depend on how the probe was built
        if c.kind == "vae":
            data, model, task, extra = self._vae(probe, train_src)
        else:
            targets = TargetConfig(mode=c.targets, rank=c.rank, power=c.power, oversample=c.oversample, seed=c.train.seed,
                                   keep_basis=c.kind == "spn", block_norms=c.target == "block-norm")
            data, model, task, extra = (self._spn if c.kind == "spn" else self._head)(probe, train_src, targets)
        extra = {"probe": self.spec.to_dict(), "images": dict(train_src.describe(), count=len(train_src)), **extra}
        at_init = self._evaluate(c.kind, model, probe, held_src) if c.kind != "vae" and self.info.is_main and not c.resume else None
        fit(task, model, data, c.train, self.out, extra_config=extra, resume=c.resume, progress=c.progress)
        if not self.info.is_main:
            return {}
        heldout = self._evaluate(c.kind, model, probe, held_src)
        results = {"kind": c.kind, "probe": self.spec.to_dict(), "train": asdict(c.train), "num_train_images": len(train_src),
                   "heldout": heldout, "heldout_images": dict(held_src.describe(), count=len(held_src)), "checkpoint": str(self.out)}
        if at_init is not None:
            results["heldout_at_init"] = {k: v for k, v in at_init.items() if k != "per_image"}
        if c.kind == "head":
            results["parameters"], results["head_size"] = parameter_count(model), self.head_size
        if c.kind == "vae" and c.diagnose_images > 0:
            results["diagnosis"] = self._diagnose_latent(probe, model, held_src)
        atomic_write_json(self.out / "results.json", results)
        plot_training(self.out / METRICS_FILE, self.out / "training.png", heldout.get("per_image") if c.kind == "head" else None)
        return results

    def _diagnose_latent(self, probe, vae, source) -> dict:
        """The diagnostic (κ_cap, CV, effective ranks, regime) at the features and at the VAE latent."""
        from pullback_ext.diagnostics import DiagnoseConfig, diagnose
        from pullback_ext.metric.vae import LatentProbe

        n = min(self.config.diagnose_images, len(source))
        F = features(probe, source, 0, n)
        latent = LatentProbe(probe, vae.requires_grad_(False))
        with torch.no_grad():
            z = latent.latent(F)
        out = {}
        for name, fn, X in (("features", probe, F), ("latent", latent, z)):
            config = DiagnoseConfig(rank=min(self.config.rank, fn.ambient_dim - 1), power=2, probes=30, slq_steps=20,
                                    seed=self.config.train.seed)
            d = diagnose(fn, X, config, keep_vectors=False)
            out[name] = {"rank": d.settings["rank"], "rank_requested": config.rank, "regime": d.regime, "method": d.method,
                         "aggregate": d.aggregate}
        return out

    @torch.no_grad()
    def _distilled(self, spn_dir: str, F: Tensor) -> Tensor:
        """imp_θ of a trained SPN on the training features (the distillation target)."""
        from pullback_ext.metric.checkpoint import load_model

        spn, _ = load_model(spn_dir, kind="spn", dtype=F.dtype)
        return torch.cat([spn.metric(F[s : s + 32]).importance() for s in range(0, F.shape[0], 32)])

    def _heldout(self, probe, source) -> tuple[Tensor, dict[str, Tensor], TargetConfig]:
        """Held-out features and their reference targets, computed once."""
        if not hasattr(self, "_held"):
            F = features(probe, source, 0, len(source))
            reference = reference_targets(probe, self.config.rank, self.config.power, self.config.train.seed)
            targets = compute_targets(probe, F, reference, stream=[("heldout", i) for i in range(len(F))])
            self._held = (F.F, targets, reference)
        return self._held

    @torch.no_grad()
    def _evaluate(self, kind: str, model, probe, source) -> dict:
        from pullback_ext.metric.tasks import evaluate_head, evaluate_spn

        model.eval()
        if kind == "vae":
            F = features(probe, source, 0, len(source)).F
            recon, _, _ = model(F, torch.zeros(*F.shape[:-1], model.latent_dim, dtype=F.dtype))
            err = ((recon - F).pow(2).sum(-1) / F.pow(2).sum(-1).clamp_min(1e-30)).mean()
            return {"relative_reconstruction_error": float(err), "count": F.shape[0]}
        with torch.enable_grad():
            F, targets, reference = self._heldout(probe, source)
        result = evaluate_spn(model, F, targets["V"]) if kind == "spn" else evaluate_head(model, F, targets["importance"])
        result["reference"] = asdict(reference)
        return result
