"""``pullback subprobe``: Geosubprobe-style interventions on a linear token probe's subspace.

For a linear probe ``W [C, D]`` read per token at the output of one block, the pullback metric is
exactly ``I_N ⊗ WᵀW``; its top-k right singular vectors span the probe's geometric subspace. The
command projects the block's features onto that subspace, onto its complement and onto a random
k-dimensional subspace, and reports how much of the probe output (and, for the demo's fitted
depth probe, of its depth error) each intervention keeps.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pullback_ext.commands.values import add_backbone_arguments

    add_backbone_arguments(parser, "timm model name (random weights unless --weights) or hf:DIR (a local transformers folder)",
                           "folder of images (default with --demo: rendered scenes)", "images to intervene on (default 32)")
    parser.add_argument("--probe", required=True, metavar="FILE|fit",
                        help="linear token probe: a weights file with 'weight' [C, D] and optional 'bias' [C], or 'fit' "
                             "(--demo: a per-token depth probe fitted on rendered scenes)")
    parser.add_argument("--layer", type=int, default=None, help="block whose output the probe reads (default: the middle block)")
    parser.add_argument("--k", default="1,2,4,8", help="subspace dimensions (default 1,2,4,8)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", required=True, help="output folder (subspace.json)")


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch

    from pullback_ext.commands.values import comma_ints
    from pullback_ext.errors import PullbackError
    from pullback_ext.prune import options
    from pullback_ext.prune.report import write_json

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.demo == bool(args.model):
        raise PullbackError("give exactly one of --demo or --model NAME")
    if args.num_images < 1:
        raise PullbackError(f"--num-images must be at least 1; got {args.num_images}")
    ks = comma_ints(args.k, "--k")
    backbone, model = options.load_backbone(demo=args.demo, model_name=args.model, weights=args.weights)
    layer = backbone.depth // 2 if args.layer is None else args.layer
    image_sets = options.image_sets(args.images, backbone, args.demo, args.num_images, 1)
    result = options.subspace_report(args.probe, model, backbone, layer, ks, image_sets[0], args.demo)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(result, out / "subspace.json")
    print(json.dumps(result["results"], indent=1))
    print(f"wrote {out / 'subspace.json'}")
    return 0
