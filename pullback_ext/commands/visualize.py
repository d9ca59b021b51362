"""``pullback visualize``: pictures of the merges — every merged group of a reduced forward painted
one colour over the image at chosen blocks, pruned tokens hatched, beside the decoder's output with
and without the reduction (:mod:`pullback_ext.visualize`)."""

from __future__ import annotations

import argparse

from pullback_ext.progress import info_line

FILES = ("groups.json", "image-*.png")  # what a run writes in --out
MODES = ("auto", "merge", "prune")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pullback_ext.commands.arguments import add_overwrite_argument, add_source_arguments

    add_source_arguments(parser, 4, "images drawn",
                         model_help="demo (its depth map is drawn too), timm:NAME (random weights unless --weights) or hf:DIR, "
                                    "a local transformers folder (DPT / Depth Anything: their depth map is drawn too)")
    red = parser.add_argument_group("reduction")
    red.add_argument("--strategy", required=True, metavar="NAME",
                     help="the method, as patch's strategy= (tome, evit, importance_tome, tome_score, random, …)")
    red.add_argument("--r", type=int, default=None, help="tokens merged per block (ToMe and the methods on its loop)")
    red.add_argument("--ratio", type=float, default=None, help="fraction of patch tokens removed (the single-stage strategies, ASAP, TAP)")
    red.add_argument("--layers", default=None, metavar="L1,L2,...",
                     help="the blocks at whose input tokens are reduced, as patch's layers= (strategies that take it; "
                          "default: block depth/3, as pullback evaluate)")
    red.add_argument("--mode", choices=MODES, default=None,
                     help="merge or prune (strategies that take it; auto, the default: prune on a depth-only model, else merge)")
    red.add_argument("--head", default=None, metavar="DIR",
                     help="an importance head or SPN trained with pullback train (strategies that read one; its importance is drawn)")
    red.add_argument("--option", action="append", default=None, metavar="FIELD=VALUE",
                     help="any other reduction option, as patch's keyword (e.g. schedule=decreasing, keep_rate=0.7, "
                          "block_range=2,6); a comma list is a tuple; repeatable")
    out = parser.add_argument_group("output")
    out.add_argument("--blocks", required=True, metavar="B1,B2,...",
                     help="the blocks after which the groups are drawn (0-based, e.g. 2,5)")
    out.add_argument("--out", required=True, help="output folder (image-NNN.png per image, groups.json)")
    add_overwrite_argument(out)


def reduction_overrides(args: argparse.Namespace, depth: int) -> dict:
    """The reduction options of the command line: ``--strategy``, ``--r``, ``--ratio``, ``--layers``,
    ``--mode`` and every ``--option FIELD=VALUE`` (a field given twice is refused)."""
    from pullback_ext.commands.arguments import option_value
    from pullback_ext.errors import PullbackError
    from pullback_ext.prune import methods
    from pullback_ext.prune.schedules import scale_layers
    from pullback_ext.studies.layers import parse_layers

    values: dict = {"strategy": args.strategy}
    method = methods.get(args.strategy)
    for name in ("r", "ratio", "mode"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.layers is not None:
        values["layers"] = parse_layers(args.layers, 0, depth - 1)
    elif "layers" in method.takes:
        values["layers"] = scale_layers((4,), depth)
    for text in args.option or ():
        name, eq, given = text.partition("=")
        name = name.strip()
        if not (eq and name and given.strip()):
            raise PullbackError(f"--option: expected FIELD=VALUE (e.g. schedule=decreasing); got {text!r}")
        if name in values or name in ("head", "spn"):
            raise PullbackError(f"--option {text}: {name} is given twice or has its own flag (--{name.replace('_', '-')})")
        parts = [option_value(v.strip()) for v in given.split(",") if v.strip()]
        values[name] = parts[0] if len(parts) == 1 else tuple(parts)
    return values


def setting_text(values: dict) -> str:
    """``tome r=8``: the strategy and the options given, for titles."""
    knobs = " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in values.items() if k != "strategy")
    return f"{values['strategy']} {knobs}".strip()


def run(args: argparse.Namespace) -> int:
    from pullback_ext.commands.arguments import image_source, model_spec, results_folder
    from pullback_ext.commands.evaluate_plan import load_metric
    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.fileio import atomic_write_json
    from pullback_ext.progress import progress_bar
    from pullback_ext.prune import methods
    from pullback_ext.prune.reduction_options import ReductionOptions
    from pullback_ext.studies.layers import parse_layers
    from pullback_ext.visualize import group_maps, plot_merges

    spec = model_spec(args)
    methods.get(args.strategy)  # an unknown strategy is refused before any work
    out = results_folder(args, FILES, "pictures of the merges")
    images = image_source(args, spec)
    backbone, model = load_backbone(spec, args.weights)
    blocks = parse_layers(args.blocks, 0, backbone.depth - 1, flag="--blocks")
    values = reduction_overrides(args, backbone.depth)
    head = None if args.head is None else load_metric(args.head, backbone.features_dim)[0]
    options = ReductionOptions(**values, **({"head": head} if head is not None else {}))
    image_set = images.seed_sets(backbone.preprocess, args.num_images, 1)[0]
    names, setting = image_set.names(), setting_text(values)
    drawn = []  # the folder is made by the first picture's atomic write, once its forward ran
    for i in progress_bar(range(len(names)), desc="visualize", unit="image"):
        batch = image_set.load([i])["images"]
        maps = group_maps(model, batch, blocks, options)
        file = f"image-{i:03d}.png"
        plot_merges(maps, 0, out / file, title=f"{setting} on {maps.model}: {names[i]}")
        drawn.append({"name": names[i], "file": file, "blocks": {str(b): c for b, c in maps.counts(0).items()}})
    record = {"command": args.command_line, "model": backbone.name, "strategy": args.strategy, "setting": setting,
              "options": maps.options.to_dict() if drawn else None, "blocks": list(blocks), "grid": list(maps.grid) if drawn else None,
              "images": drawn}
    atomic_write_json(out / "groups.json", record)
    for stale in set(p.name for p in out.glob("image-*.png")) - {d["file"] for d in drawn}:  # --overwrite of a longer run
        (out / stale).unlink()
    info_line(f"wrote {len(drawn)} picture{'s' if len(drawn) != 1 else ''} and {out / 'groups.json'}")
    return 0
