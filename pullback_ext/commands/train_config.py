"""The training run of the ``pullback train`` arguments: its configuration (:func:`run_config`,
with the probe of :func:`probe_spec`) and the printout of its held-out figures
(:func:`print_results`) and the check of its output folder (:func:`training_folder`), shared by a single run (:mod:`pullback_ext.commands.train`) and a schedule
of heads, one run per stage (:mod:`pullback_ext.commands.train_schedule`).
"""

from __future__ import annotations

import argparse

from pullback_ext.progress import info_line

# what a training run writes in --out (the target cache, reused by key, is not an earlier result)
RUN_FILES = ("state.safetensors", "model.safetensors", "config.json", "metrics.jsonl", "results.json", "training.png")


def probe_spec(args: argparse.Namespace, model):
    """The :class:`~pullback_ext.metric.probe_spec.ProbeSpec` of the arguments, for ``model``."""
    from pullback_ext.commands.arguments import probe_decoder
    from pullback_ext.errors import PullbackError
    from pullback_ext.metric.probe_spec import ProbeSpec

    if args.layer is None:
        raise PullbackError("--layer: required (the probe layer ℓ; or --stages for one head per stage)")
    return ProbeSpec(model=str(model), layer=args.layer, decoder=probe_decoder(args, str(model), default="cls"), weights=args.weights,
                     output_size=args.output_size, img_size=args.img_size, vae=args.vae)


def run_config(args: argparse.Namespace):
    """The :class:`~pullback_ext.metric.training_run.TrainingRunConfig` of the arguments."""
    from pathlib import Path

    from pullback_ext.commands.arguments import image_source, model_spec, renamed_switch
    from pullback_ext.metric.training import TrainConfig
    from pullback_ext.metric.training_run import TrainingRunConfig
    from pullback_ext.sources.images import open_images

    model = model_spec(args)
    spec = probe_spec(args, model)
    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                        warmup_steps=min(args.warmup, args.steps), amp=args.amp, seed=args.seed,
                        checkpoint_every=args.checkpoint_every, ema_decay=args.ema)
    return TrainingRunConfig(
        kind=args.kind, probe=spec, images=image_source(args, model), out=Path(args.out), train=train,
        eval_images=None if args.eval_images is None else open_images(args.eval_images, "--eval-images"),
        num_images=args.num_images, num_heldout=args.heldout, dtype=args.dtype, rank=args.rank, targets=args.targets,
        power=args.power, oversample=args.oversample, on_the_fly=args.on_the_fly,
        cache=None if args.cache is None else Path(args.cache), target=args.target, w_rank=args.w_rank,
        w_order=args.w_order, hidden=args.hidden, heads=args.heads, mlp_hidden=args.mlp_hidden, eps=args.eps,
        latent_dim=args.latent_dim, beta=args.beta, diagnose_images=args.diagnose_images, resume=args.resume,
        progress=not renamed_switch(args, "--no-progress", "--quiet"),
    )


def training_folder(args: argparse.Namespace):
    """``--out`` of a training run, checked before any work: a folder holding an earlier run is
    refused unless ``--resume`` continues it or ``--overwrite`` replaces it."""
    from pullback_ext.commands.arguments import results_folder

    return results_folder(args, RUN_FILES, "a training run", resumable=True)


def print_results(kind: str, results: dict, out) -> None:
    """The held-out figures of a finished run of ``kind`` and where they were written."""
    held = results["heldout"]
    if kind == "vae":
        print(f"held-out relative reconstruction error: {held['relative_reconstruction_error']:.4f} ({held['count']} images)")
    else:
        label = "subspace alignment" if kind == "spn" else "Spearman rho vs imp*"
        init = results.get("heldout_at_init", {}).get("mean")
        print(f"held-out {label}: {held['mean']:.4f} ± {held['std']:.4f} over {held['count']} images"
              + (f" (at initialisation: {init:.4f})" if init is not None else ""))
    info_line(f"wrote {out / 'results.json'}")
