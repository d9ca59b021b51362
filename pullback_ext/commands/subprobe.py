"""``pullback subprobe``: Geosubprobe-style interventions on a linear token probe's subspace.

For a linear probe ``W [C, D]`` read per token at the output of one block, the pullback metric is
exactly ``I_N ⊗ WᵀW``; its top-k right singular vectors span the probe's geometric subspace. The
command projects the block's features onto that subspace, onto its complement and onto a random
k-dimensional subspace, and reports how much of the probe output (and, for the demo's fitted
depth probe on rendered scenes, of its depth error) each intervention keeps.
"""

from __future__ import annotations

import argparse

from pullback_ext.progress import info_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pullback_ext.commands.arguments import add_overwrite_argument, add_source_arguments

    add_source_arguments(parser, 32, "images to intervene on")
    parser.add_argument("--probe", required=True, metavar="FILE|fit",
                        help="linear token probe: a weights file with 'weight' [C, D] and optional 'bias' [C], or 'fit' "
                             "(--model demo: a per-token depth probe fitted on rendered scenes)")
    parser.add_argument("--layer", type=int, default=None, help="block whose output the probe reads (default: the middle block)")
    parser.add_argument("--k", default="1,2,4,8", help="subspace dimensions (default 1,2,4,8)")
    parser.add_argument("--out", required=True, help="output folder (subspace.json)")
    add_overwrite_argument(parser)


def subspace_report(probe: str, model, backbone, layer: int, ks: tuple, data: dict) -> dict:
    """Interventions on a linear token probe read at the output of block ``layer`` of ``backbone``,
    on ``data`` (``images``, and ``depth`` where known: the fitted probe's depth error)."""
    from pullback_ext.comparison.backbones import block_output_tokens
    from pullback_ext.errors import CheckpointError, PullbackError
    from pullback_ext.sources.weights import read_state_dict
    from pullback_ext.studies.subspace import interventions, subspace_analysis

    if not 0 <= layer < backbone.depth:
        raise PullbackError(f"--layer must lie in [0, {backbone.depth - 1}]; got {layer}")
    if probe == "fit":
        if backbone.name != "demo":
            raise PullbackError("--probe fit needs --model demo (depth targets of rendered scenes); give a probe file otherwise")
        return subspace_analysis(model, layer, 128, data, quick=False, ks=ks)
    state = read_state_dict(probe, flag="--probe")
    weight, bias = state.get("weight"), state.get("bias")
    if weight is None or weight.dim() != 2 or weight.shape[1] != backbone.features_dim:
        got = None if weight is None else tuple(weight.shape)
        raise CheckpointError(f"--probe: {probe} needs 'weight' of shape [C, {backbone.features_dim}]; got {got}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise CheckpointError(f"--probe: 'bias' must have shape [{weight.shape[0]}]; got {tuple(bias.shape)}")
    tokens = block_output_tokens(backbone, data["images"], layer)
    result = interventions(tokens, weight.to(tokens.dtype), None if bias is None else bias.to(tokens.dtype), ks=ks)
    result["layer"] = layer
    return result


def run(args: argparse.Namespace) -> int:
    import json

    from pullback_ext.commands.arguments import comma_ints, image_source, model_spec, results_folder
    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.comparison.report import write_json

    spec = model_spec(args)
    out = results_folder(args, ("subspace.json",), "subprobe results")
    images = image_source(args, spec)
    ks = comma_ints(args.k, "--k")
    backbone, model = load_backbone(spec, args.weights)
    layer = backbone.depth // 2 if args.layer is None else args.layer
    data = images.seed_sets(backbone.preprocess, args.num_images, 1)[0].load()
    result = subspace_report(args.probe, model, backbone, layer, ks, data)
    out.mkdir(parents=True, exist_ok=True)
    write_json(result, out / "subspace.json")
    print(json.dumps(result["results"], indent=1))
    info_line(f"wrote {out / 'subspace.json'}")
    return 0
