"""``pullback eval-head``: per-image Spearman ρ of a trained importance head against imp*.

The probe is rebuilt from the definition stored in the checkpoint (flags override it). imp* comes
from the exact SVD when min(M, P) allows, else from a randomized SVD (--rank, --power). Under
``torchrun`` the images are sharded over ranks and gathered on rank 0.
"""

from __future__ import annotations

import argparse

from pullback_ext.progress import info_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pullback_ext.commands.arguments import add_overwrite_argument, add_renamed
    from pullback_ext.commands.train import add_probe_arguments

    parser.add_argument("--head", metavar="DIR", help="required: a head trained with `pullback train head` (its --out folder)")
    add_renamed(parser, "--checkpoint", "--head", metavar="DIR")
    add_probe_arguments(parser)
    parser.add_argument("--rank", type=int, default=20, help="rank of imp*")
    parser.add_argument("--power", type=int, default=4, help="power rounds when imp* needs a randomized SVD (4, more than training targets get: imp* is the reference the head is scored against)")
    parser.add_argument("--target", default="imp", choices=["imp", "block-norm"], help="compare with imp* or the plain block norms")
    parser.add_argument("--out", default=None, metavar="DIR", help="write the result to DIR/results.json (a FILE.json: "
                        "deprecated, written as before)")
    add_overwrite_argument(parser)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict, replace
    from pathlib import Path

    import torch

    from pullback_ext import distributed
    from pullback_ext.commands.arguments import image_source, model_spec, probe_decoder, refuse_earlier_results, renamed, result_file
    from pullback_ext.errors import PullbackError
    from pullback_ext.fileio import atomic_write_json
    from pullback_ext.metric.checkpoint import load_model
    from pullback_ext.metric.evaluation import spearman_per_image, summarize
    from pullback_ext.metric.probe_spec import ProbeSpec, build_probe, features
    from pullback_ext.metric.targets import compute_targets
    from pullback_ext.metric.training_run import reference_targets
    from pullback_ext.sources.models import parse_model

    args.head = renamed(args, "--checkpoint", "--head")
    if args.head is None:
        raise PullbackError("--head: required (a head trained with `pullback train head`)")
    out = result_file(args.out) if args.out else None
    if out is not None:
        refuse_earlier_results(args, out.parent, (out.name,), "a head evaluation")
    if args.rank < 1 or args.power < 0:
        raise PullbackError(f"--rank/--power: expected rank >= 1 and power >= 0, got {args.rank}, {args.power}")
    head, config = load_model(args.head, kind="head")
    if "probe" not in config:
        raise PullbackError(f"--head: {args.head!r} has no probe definition; pass --model/--layer/--task")
    spec = ProbeSpec.from_dict(config["probe"])
    overrides = {k: getattr(args, k) for k in ("weights", "layer", "output_size", "img_size", "vae") if getattr(args, k) is not None}
    model = model_spec(args, required=False)
    if model is not None:
        overrides["model"] = str(model)
    decoder = probe_decoder(args, overrides.get("model", spec.model))
    if decoder is not None:
        overrides["decoder"] = decoder
    spec = replace(spec, **overrides)
    # with a folder the held-out images are the files after the --num-images training ones
    images = image_source(args, parse_model(spec.model))
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    torch.manual_seed(args.seed)
    probe, preprocess = build_probe(spec, dtype)
    if head.dim != probe.dim:
        raise PullbackError(f"--head: the head reads D={head.dim} features, the probe gives D={probe.dim}")
    head = head.to(dtype)
    held = images.heldout(preprocess, args.heldout, after=args.num_images)
    reference = replace(reference_targets(probe, args.rank, args.power, args.seed), block_norms=args.target == "block-norm", keep_basis=False)
    info = distributed.init_from_env()
    try:
        mine = distributed.shard_indices(len(held), info.rank, info.world_size)
        rows = []
        for i in mine:
            F = features(probe, held, i, i + 1)
            t = compute_targets(probe, F, reference, stream=[("heldout", i)])
            with torch.no_grad():
                rho = spearman_per_image(head(F.F), t["block_norm" if args.target == "block-norm" else "importance"])
            rows.append((i, float(rho[0])))
        gathered = sorted(r for part in distributed.gather_objects(rows, info) for r in part)
    finally:
        distributed.shutdown(info)
    if not info.is_main:
        return 0
    rho = torch.tensor([r for _, r in gathered], dtype=torch.float64)
    result = {"checkpoint": str(Path(args.head)), "probe": spec.to_dict(), "images": held.describe(),
              "reference": asdict(reference), "target": args.target, "spearman": summarize(rho), "per_image": rho.tolist()}
    s = result["spearman"]
    print(f"Spearman rho vs {'imp*' if args.target == 'imp' else 'block norms'}: {s['mean']:.4f} ± {s['std']:.4f} "
          f"(min {s['min']:.4f}, {s['count']} images)")
    if out is not None:
        atomic_write_json(out, result)
        info_line(f"wrote {out}")
    return 0
