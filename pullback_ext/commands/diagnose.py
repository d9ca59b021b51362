"""``pullback diagnose``: matrix-free tractability diagnostic of a backbone–decoder pair on an
image folder; writes DIR/diagnosis.json and plots, prints a Table-1-style summary.

Runs under ``torchrun --nproc_per_node=N -m pullback_ext diagnose ...``: images are sharded over
ranks, every image uses the random stream of its global index, and rank 0 gathers and writes, so
the result equals the single-process one.
"""

from __future__ import annotations

import argparse

from pullback_ext.progress import info_line

OUTPUTS = ("diagnosis.json", "spectrum.png", "token_energy.png")  # what a run writes in --out


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pullback_ext.commands.arguments import add_overwrite_argument, add_source_arguments, add_task_argument

    add_source_arguments(parser, 50, "the first N images (a folder's sorted by name)", img_size=True)
    parser.add_argument("--layer", type=int, default=None, help="probe layer ℓ (0-based block index; F is its output)")
    add_task_argument(parser)
    parser.add_argument("--output-size", type=_positive, default=None, help="resize dense outputs to S×S (M = S²)")
    parser.add_argument("--rank", type=int, default=20, help="r: captured subspace for κ_cap(r), CV, importance")
    parser.add_argument("--oversample", type=int, default=10, help="randomized-SVD oversampling p (sketch r + p)")
    parser.add_argument("--power", type=int, default=2, help="q power rounds (2, the spec's default for diagnosis)")
    parser.add_argument("--adaptive-tol", type=float, default=None, help="stop power rounds when the subspace defect is below this")
    parser.add_argument("--probes", type=int, default=100, help="m Rademacher probes (Hutchinson / Hutch++ / SLQ)")
    parser.add_argument("--slq-steps", type=int, default=30, help="Lanczos steps for r_eff^SLQ (0 skips it)")
    parser.add_argument("--trace", default="auto", choices=["auto", "exact", "hutchinson", "hutch++", "xnystrace"], help="auto: exact when min(M, P) <= 512, else xnystrace")
    parser.add_argument("--svd", default="auto", choices=["auto", "randomized", "dense"],
                        help="auto: dense (exact, from the exact trace's products) whenever the trace is exact and J fits in 1 GiB")
    parser.add_argument("--seed", type=int, default=0, help="image i draws from a stream seeded by (seed, i)")
    parser.add_argument("--chunk-size", type=int, default=32, help="tangents per vmap call (bounds memory)")
    parser.add_argument("--batch-size", type=_positive, default=8, help="images per feature-extraction batch")
    parser.add_argument("--kappa-threshold", type=float, default=0.9, help="regimes: κ_cap(r) at or above is low rank")
    parser.add_argument("--cv-threshold", type=float, default=1.0, help="regimes: CV at or above is localised")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--save-vectors", action="store_true", help="include V[r,N,D] in the JSON")
    parser.add_argument("--random-weights", action="store_true",
                        help="hf:DIR without weights: measure its random initialisation (recorded in the JSON, printed in the summary)")
    parser.add_argument("--out", required=True, help="output folder")
    add_overwrite_argument(parser)


def summary_table(result, description: dict) -> str:
    """Table-1-style rows: one line per setting with mean ± std over images."""
    from pullback_ext.commands.arguments import task_name
    from pullback_ext.diagnostics import REDUCTION, REGIMES, r90_note

    agg = result.aggregate
    first = result.images[0]

    def cell(name: str, fmt: str = ".3f") -> str:
        if name not in agg:
            return "n/a"
        return f"{agg[name]['mean']:{fmt}} ± {agg[name]['std']:{fmt}}"

    header = f"{'model':<28} {'layer':>5} {'task':<12} {'M':>7} {'P':>8} {'r':>3} {'κ_cap(r)':>17} {'CV':>17} {'r_eff^trunc':>17} {'r_eff^SLQ':>19} {'r90':>13}  regime"
    row = (
        f"{description['model'][:28]:<28} {description['layer']:>5} {task_name(description['decoder'], description['model'])[:12]:<12} {first.M:>7} {first.P:>8} {first.rank:>3} "
        f"{cell('kappa_cap'):>17} {cell('cv'):>17} {cell('r_eff_trunc', '.2f'):>17} {cell('r_eff_slq', '.2f'):>19} {cell('r90', '.1f'):>13}  "
        f"({result.regime}) {REGIMES[result.regime][0]}"
    )
    weights = ", RANDOM WEIGHTS (no trained weights loaded)" if description.get("random_weights") else ""
    lines = [header, row, f"recommended: {result.method}  [{len(result)} images, trace: {first.trace_method}{weights}]",
             f"token reduction: {REDUCTION[result.regime]}"]
    note = r90_note(agg, len(result), first.rank)
    return "\n".join(lines if note is None else [*lines, note])


def diagnose_config(args: argparse.Namespace):
    """The ``DiagnoseConfig`` of the command line (its validation reports a bad setting)."""
    from pullback_ext.diagnostics import DiagnoseConfig, Thresholds

    return DiagnoseConfig(
        rank=args.rank, oversample=args.oversample, power=args.power, probes=args.probes, slq_steps=args.slq_steps,
        trace=args.trace, svd=args.svd, seed=args.seed, chunk_size=args.chunk_size, adaptive_tol=args.adaptive_tol,
        thresholds=Thresholds(kappa=args.kappa_threshold, cv=args.cv_threshold),
    )


def probe_and_images(args: argparse.Namespace, dtype):
    """``(ProbeSetup, ImageSource, ImageSet)`` of ``--model``/``--weights``/``--images``: the
    probe, where the images come from, and up to ``--num-images`` of them prepared for the model."""
    from pullback_ext.commands.arguments import image_source, model_spec, probe_decoder
    from pullback_ext.sources.probe_setup import build_probe_setup

    model = model_spec(args)
    source = image_source(args, model)
    layer = args.layer if args.layer is not None else 0
    decoder = probe_decoder(args, str(model), default="cls")
    setup = build_probe_setup(model, args.weights, layer, decoder, args.output_size, args.img_size, dtype,
                              random_weights=args.random_weights)
    return setup, source, source.heldout(setup.preprocess, args.num_images, partial=True)


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    import torch

    from pullback_ext import distributed
    from pullback_ext.commands.arguments import results_folder
    from pullback_ext.diagnostics import Diagnosis, diagnose
    from pullback_ext.errors import PullbackError
    from pullback_ext.fileio import atomic_write_text
    from pullback_ext.plots import plot_spectrum, plot_token_energy
    from pullback_ext.progress import progress_bar

    if args.layer is None and "depth-multi" not in (args.task, args.deprecated_decoder):
        raise PullbackError("--layer: required (the probe layer ℓ) unless --task depth-multi")
    config = diagnose_config(args)
    out = results_folder(args, OUTPUTS, "a diagnosis")
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    setup, source, image_set = probe_and_images(args, dtype)
    names = image_set.names()
    probe = setup.probe
    if setup.description["random_weights"] and not args.random_weights:
        print("pullback diagnose: note: no --weights given, the model keeps its random initialisation", file=sys.stderr)
    config.check_rank(probe.ambient_dim)

    info = distributed.init_from_env()
    try:
        mine = distributed.shard_indices(len(image_set), info.rank, info.world_size)
        per_image = []
        desc = f"diagnose[rank {info.rank}/{info.world_size}]" if info.world_size > 1 else "diagnose"
        with progress_bar(total=len(mine), desc=desc, unit="image", enabled=info.is_main) as bar:
            for start in range(0, len(mine), args.batch_size):
                indices = mine[start : start + args.batch_size]
                images = image_set.images(indices).to(dtype)
                F = probe.features(images)
                result = diagnose(probe, F, config, indices=indices, keep_vectors=args.save_vectors)
                per_image.extend(result.images)
                bar.update(len(indices))
        gathered = [d for part in distributed.gather_objects(per_image, info) for d in part]
    finally:
        distributed.shutdown(info)
    if not info.is_main:
        return 0

    gathered.sort(key=lambda d: d.index)
    full = Diagnosis.from_images(gathered, config)
    full.settings = dict(
        setup.description, images=source.spec, num_images=len(image_set), **full.settings, dtype=args.dtype,
        world_size=info.world_size, files=names,
    )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "diagnosis.json", json.dumps(full.to_dict(include_vectors=args.save_vectors), indent=1))
    plot_spectrum([d.sigma for d in gathered], [d.trace for d in gathered], out / "spectrum.png", kappa_threshold=config.thresholds.kappa)
    plot_token_energy(
        [d.token_energy for d in gathered], probe.num_prefix_tokens, out / "token_energy.png",
        grid_size=getattr(probe, "grid_size", None), titles=names,
    )
    print(summary_table(full, setup.description))
    info_line(f"wrote {out / 'diagnosis.json'}, {out / 'spectrum.png'}, {out / 'token_energy.png'}")
    return 0
