"""One ``pullback train`` run: probe, images, targets, model, training loop, held-out evaluation."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pullback_ext.fileio import atomic_write_json
from pullback_ext.metric.data import ProbeSpec, build_probe, features, image_sources
from pullback_ext.metric.targets import EXACT_MAX_SIDE, TargetCache, TargetConfig, compute_targets

SHARD_SIZE = 32


def reference_targets(probe, rank: int, power: int, seed: int, block_norms: bool = False) -> TargetConfig:
    """The most accurate targets affordable for evaluation: exact when min(M, P) allows, else a
    randomized SVD with at least 4 power rounds."""
    M, P = probe.output_dim, probe.num_tokens * probe.dim
    if min(M, P) <= EXACT_MAX_SIDE:
        return TargetConfig(mode="exact", rank=rank, seed=seed, block_norms=block_norms)
    return TargetConfig(mode="randnla", rank=rank, power=max(power, 4), seed=seed, block_norms=block_norms)


def plot_training(metrics_file: Path, out_file: Path, rho: list[float] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    panels = 2 if rho else 1
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 3.4), squeeze=False)
    ax = axes[0][0]
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    if rho:
        axes[0][1].hist(rho, bins=20)
        axes[0][1].set_xlabel("held-out Spearman ρ per image")
    fig.tight_layout()
    tmp = out_file.with_name(f".{out_file.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out_file)


class TrainingRun:
    def __init__(self, args: argparse.Namespace, spec: ProbeSpec, info) -> None:
        self.args, self.spec, self.info = args, spec, info
        self.out = Path(args.out)
        self.dtype = torch.float64 if args.dtype == "float64" else torch.float32

    def _barrier(self) -> None:
        if self.info.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def _targets(self, probe, source, config: TargetConfig) -> dict[str, Tensor]:
        """Cached targets of the training images, shards split over ranks."""
        a = self.args
        cache = TargetCache(a.cache or self.out / "targets")
        described = {"probe": self.spec.to_dict(), "images": source.describe(), "dtype": a.dtype}
        fetch = lambda s, e: features(probe, source, s, e)
        progress = not a.no_progress and self.info.is_main
        if self.info.world_size == 1:
            return cache.build(probe, fetch, len(source), config, described, SHARD_SIZE, progress)
        cache.build(probe, fetch, len(source), config, described, SHARD_SIZE, progress, self.info.rank, self.info.world_size)
        self._barrier()
        if self.info.is_main:
            cache.write_manifest(len(source), config, described, SHARD_SIZE)
        self._barrier()
        return cache.load(config, described)

    def run(self) -> dict[str, Any]:
        from pullback_ext.errors import PullbackError
        from pullback_ext.metric.head import ImportanceHead, parameter_count
        from pullback_ext.metric.spn import SPN
        from pullback_ext.metric.tasks import HeadTask, SPNTask, VAETask
        from pullback_ext.metric.training import METRICS_FILE, TrainConfig, fit
        from pullback_ext.metric.vae import FeatureVAE

        a = self.args
        torch.manual_seed(a.seed)
        probe, preprocess = build_probe(self.spec, self.dtype)
        train_src, held_src = image_sources(a.images, a.demo or self.spec.model == "demo", a.num_images, a.heldout, preprocess)
        P = probe.num_tokens * probe.dim
        if a.rank > P:
            raise PullbackError(f"--rank: expected r <= P = N·D = {P}, got {a.rank}")
        torch.manual_seed(a.seed)  # the model's initialisation must not depend on how the probe was built
        extra: dict[str, Any] = {"probe": self.spec.to_dict(), "images": dict(train_src.describe(), count=len(train_src))}
        if a.kind == "vae":
            data = {"features": features(probe, train_src, 0, len(train_src)).F}
            model = FeatureVAE(probe.dim, a.latent_dim, a.hidden).to(self.dtype)
            model.fit_normalization(data["features"])
            task: Any = VAETask(beta=a.beta, seed=a.seed)
            extra["beta"] = a.beta
        else:
            config = TargetConfig(mode=a.targets, rank=a.rank, power=a.power, oversample=a.oversample, seed=a.seed,
                                  keep_basis=a.kind == "spn", block_norms=a.target == "block-norm")
            extra["targets"] = asdict(config)
            if a.kind == "spn" and a.on_the_fly:
                if probe.context_keys:
                    raise PullbackError("--on-the-fly: this probe reads per-image decoder context besides F; use cached targets")
                data = {"features": features(probe, train_src, 0, len(train_src)).F}
                task = SPNTask(config, probe=probe, w_order=a.w_order)
                extra["targets"]["on_the_fly"] = True
            else:
                data = self._targets(probe, train_src, config)
                task = SPNTask(config, w_order=a.w_order) if a.kind == "spn" else HeadTask(target="importance", w_rank=a.w_rank)
            if a.kind == "spn":
                extra["w_order"] = a.w_order
                model = SPN(probe.dim, a.rank, a.hidden, a.heads, a.eps).to(self.dtype)
                sample = data if "sigma" in data else compute_targets(probe, data["features"][:8], config)
                model.set_energy_scale(sample["sigma"][:, : min(a.rank, sample["V"].shape[-1])] ** 2)
            else:
                model = ImportanceHead(probe.dim, a.hidden, a.heads, a.mlp_hidden).to(self.dtype)
                if self.info.is_main:
                    print(f"ImportanceHead(dim={probe.dim}, hidden={a.hidden}, heads={a.heads}, mlp_hidden={a.mlp_hidden}): "
                          f"{parameter_count(model):,} parameters", flush=True)
                task.target = "block_norm" if a.target == "block-norm" else "importance"
                if a.target.startswith("spn:"):
                    data["importance"] = self._distilled(a.target[4:], data["features"])
                model.set_score_offset(data[task.target])
                extra.update(target=a.target, w_rank=a.w_rank)
        at_init = self._evaluate(a.kind, model, probe, held_src) if a.kind != "vae" and self.info.is_main and not a.resume else None
        cfg = TrainConfig(steps=a.steps, batch_size=a.batch_size, lr=a.lr, weight_decay=a.weight_decay, warmup_steps=min(a.warmup, a.steps),
                          amp=a.amp, seed=a.seed, checkpoint_every=a.checkpoint_every, ema_decay=a.ema)
        fit(task, model, data, cfg, self.out, extra_config=extra, resume=a.resume, progress=not a.no_progress)
        if not self.info.is_main:
            return {}
        heldout = self._evaluate(a.kind, model, probe, held_src)
        results = {"kind": a.kind, "probe": self.spec.to_dict(), "train": asdict(cfg), "num_train_images": len(train_src),
                   "heldout": heldout, "checkpoint": str(self.out)}
        if at_init is not None:
            results["heldout_at_init"] = {k: v for k, v in at_init.items() if k != "per_image"}
        if a.kind == "head":
            results["parameters"] = parameter_count(model)
        if a.kind == "vae" and a.diagnose_images > 0:
            results["diagnosis"] = self._diagnose_latent(probe, model, held_src)
        atomic_write_json(self.out / "results.json", results)
        plot_training(self.out / METRICS_FILE, self.out / "training.png", heldout.get("per_image") if a.kind == "head" else None)
        return results

    def _diagnose_latent(self, probe, vae, source) -> dict:
        """The diagnostic (κ_cap, CV, effective ranks, regime) at the features and at the VAE latent."""
        from pullback_ext.diagnostics import DiagnoseConfig, diagnose
        from pullback_ext.metric.vae import LatentProbe

        n = min(self.args.diagnose_images, len(source))
        F = features(probe, source, 0, n)
        latent = LatentProbe(probe, vae.requires_grad_(False))
        with torch.no_grad():
            z = latent.latent(F)
        out = {}
        for name, fn, X in (("features", probe, F), ("latent", latent, z)):
            config = DiagnoseConfig(rank=min(self.args.rank, fn.ambient_dim - 1), power=2, probes=30, slq_steps=20, seed=self.args.seed)
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
            reference = reference_targets(probe, self.args.rank, self.args.power, self.args.seed)
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
