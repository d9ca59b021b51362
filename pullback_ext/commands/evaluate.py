"""``pullback evaluate``: token pruning / merging quality and cost against baselines."""

from __future__ import annotations

import argparse

from pullback_ext.progress import info_line

DEFAULT_RATIOS = "0.05,0.1,0.15,0.2,0.3,0.4,0.5"
FILES = ("results.json", "table.md", "quality.png")  # what a run writes in --out
PARETO_FILES = ("pareto.json", "pareto.md", "pareto.png")  # what a --pareto run writes there
LLF_CHOICES = {"on": (True,), "full": ("full",), "off": (False,), "both": (True, False), "all": (True, "full", False)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pullback_ext.commands.arguments import BUILTIN_HELP, add_overwrite_argument, add_source_arguments
    from pullback_ext.comparison.tasks import DENSE, TASKS
    from pullback_ext.results_pages import ALLOW_DIRTY_HELP

    add_source_arguments(parser, 32, "images per seed",
                         model_help="demo (cls, depth and segmentation tasks), timm:NAME (random weights unless --weights; cls task) or hf:DIR, "
                                    "a local transformers folder (DINOv2, ViT, CLIP, SigLIP, DINOv3: cls; DPT / Depth Anything: depth)",
                         images_help=f"a folder of images (class subfolders give k-NN labels) or a built-in set: {BUILTIN_HELP}")
    red = parser.add_argument_group("reduction")
    red.add_argument("--task", choices=tuple(TASKS), default="cls",
                     help="the output compared with the unreduced model's: cls (the CLS embedding), depth (the depth map), "
                          "segmentation (the demo's class logits: per-pixel KL and argmax mIoU; with the shipped segmentation head)")
    red.add_argument("--mode", choices=("auto", "merge", "prune"), default="auto",
                     help=f"auto: merge for cls, prune for the dense tasks ({', '.join(DENSE)})")
    red.add_argument("--head", help="importance head or SPN checkpoint (enables strategy 'importance'); a comma list gives one per stage, "
                                    "a schedule folder (pullback train head --stages) one per stage at its layers")
    red.add_argument("--spn", help="SPN checkpoint for pullback-distance matching in merge mode (default: --head if it is an SPN)")
    red.add_argument("--strategies", default=None, help="comma list (default: importance when --head is given, oracle with --oracle, and every training-free rule)")
    red.add_argument("--oracle", action="store_true", help="add the imp* oracle (--model demo only; slow: a randomized SVD per image)")
    red.add_argument("--ratios", default=DEFAULT_RATIOS, help=f"comma list of prune ratios (default {DEFAULT_RATIOS})")
    red.add_argument("--layers", default=None, metavar="L1,L2,...",
                     help="the blocks at whose input tokens are reduced: 0-based block indices of the model at hand, as patch's "
                          "layers= (default: block depth/3, e.g. 4 of 12 and 2 of 8, or the layers of a --head schedule folder)")
    red.add_argument("--stages", default=None, help="deprecated spelling of --layers: layers on a 12-block ViT-B numbering (e.g. 4,8 or "
                                                      "2stage), scaled to the model's depth")
    red.add_argument("--absolute-layers", action="store_true", help="deprecated spelling of --layers (with --stages: its indices unscaled)")
    red.add_argument("--llf", choices=tuple(LLF_CHOICES), default=None,
                     help="Last-Layer Fusion in prune mode: on (masked: kept tokens do not attend to the re-inserted ones), "
                          "full (every token attends to every token), off; both: on and off; all: all three (one table each); "
                          "default: on, or full with --preset paper")
    red.add_argument("--preset", choices=("recommended", "paper"), default="recommended",
                     help="how the auto choices are made: recommended (bound selection in merge mode, masked LLF), or paper: the "
                          "paper's literal pipeline (lowest-importance selection, importance-weighted averages, Eq. 19 matching "
                          "with an SPN, full LLF)")
    red.add_argument("--prop-attn", choices=("auto", "on", "off"), default="auto",
                     help="proportional attention after merges (auto: on in merge mode)")
    red.add_argument("--selection", choices=("auto", "lowest", "bound"), default="auto",
                     help="tokens importance/oracle merge away: lowest importance, or lowest imp·drift bound (auto: bound in merge mode)")
    red.add_argument("--recovery", type=float, default=None, metavar="ALPHA",
                     help="prune mode: re-insert each pruned token as α·frozen + (1 − α)·mean of its kept neighbours at the "
                          "prune layer (default: the frozen copy, α = 1)")
    pareto = parser.add_argument_group("matched-cost comparison")
    pareto.add_argument("--pareto", action="store_true",
                        help="sweep every method over its own knob and compare quality at matched speed-ups "
                             "(writes pareto.json, pareto.md, pareto.png)")
    pareto.add_argument("--methods", default=None, help="with --pareto: comma list of strategies, single-stage or original "
                        "(default: importance when --head is given, tome, evit, random)")
    pareto.add_argument("--device", default="cpu", help="with --pareto: where the model, the heads and the images run "
                        "(cpu, cuda or cuda:N; wall-clock then uses CUDA events)")
    pareto.add_argument("--sweep", action="append", metavar="METHOD:FIELD=V1,V2",
                        help="with --pareto: the values of one knob of one method, e.g. tome:r=4,8,16 or evit:keep_rate=0.7,0.5 "
                             "(repeatable; single-stage methods sweep ratio over --ratios by default; "
                             "importance_tome:head=trained,none gives a row with the --head checkpoint and one without)")
    pareto.add_argument("--tap", default=None, metavar="DIR[,DIR]",
                        help="with --pareto: TAP checkpoint folders (pullback train tap), one row each swept over the keep "
                             "rate ρ = 0.9..0.3 (η = 1 − ρ), plus its quality with nothing removed (ρ = 1)")
    pareto.add_argument("--trained", action="append", metavar="METHOD=DIR",
                        help="with --pareto: the learned module of a method trained by a command of its own, e.g. "
                             "dtem=runs/dtem (pullback train dtem); repeatable, one per method")
    run = parser.add_argument_group("run")
    run.add_argument("--seeds", type=int, default=3, help="image sets (folder splits or scene seeds; random-strategy seeds)")
    run.add_argument("--batch-size", type=int, default=16)
    run.add_argument("--time-batches", default="1,64", help="batch sizes for wall-clock (default 1,64)")
    run.add_argument("--time-repeats", type=int, default=None,
                     help="timed rounds (default 3, and with --pareto 7: the interleaved rounds whose per-round speed-ups "
                          "give each point's median and bootstrap 90%% interval; a --pareto --results-page needs at least 7)")
    run.add_argument("--time-strategies", default=None, help="strategies to time (default: all evaluated)")
    run.add_argument("--no-timing", action="store_true", help="skip FLOPs and wall-clock")
    run.add_argument("--out", required=True, help="output folder (results.json, table.md, quality.png; with --pareto "
                     "pareto.json, pareto.md, pareto.png)")
    add_overwrite_argument(run)
    run.add_argument("--results-page", default=None, metavar="NAME",
                     help="also publish the results as docs/results/NAME.json and a stamped page NAME.md (or DIR/NAME: into DIR)")
    run.add_argument("--allow-dirty", action="store_true", help=ALLOW_DIRTY_HELP)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pullback_ext.commands import evaluate_plan
    from pullback_ext.commands.arguments import comma_floats, comma_ints, image_source, model_spec, results_folder, warn_if_busy
    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.comparison.evaluation import Plan, check_plan, check_task, markdown_table, run_cost, run_quality
    from pullback_ext.comparison.tasks import resolve_mode
    from pullback_ext.comparison.report import plot_quality, write_json, write_text
    from pullback_ext.errors import PullbackError

    spec = model_spec(args)
    if args.pareto:
        results_folder(args, PARETO_FILES, "a matched-cost comparison")
    else:
        results_folder(args, FILES, "an evaluation")
    images = image_source(args, spec)
    _check_timing(args)
    for name in ("seeds", "batch_size", "time_repeats"):
        if getattr(args, name) < 1:
            raise PullbackError(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    ratios = comma_floats(args.ratios, "--ratios")
    time_batches = comma_ints(args.time_batches, "--time-batches")
    from pullback_ext.commands.evaluate_pareto import device

    backbone, model = load_backbone(spec, args.weights, args.task, device(args.device) if args.pareto else "cpu")
    check_task(args.task, backbone)
    if args.pareto and args.recovery is not None:
        raise PullbackError("--recovery is an option of the plain evaluation, not of --pareto")
    if args.pareto:
        return _run_pareto(args, backbone, model, images)
    if args.methods is not None or args.sweep or args.device != "cpu":
        raise PullbackError("--methods, --sweep and --device need --pareto")
    for flag, given in (("--tap", args.tap is not None), ("--trained", bool(args.trained))):
        if given:
            raise PullbackError(f"{flag} needs --pareto (its rows are part of the matched-cost comparison)")
    layers = evaluate_plan.reduction_layers(args, backbone.depth)
    mode = resolve_mode(args.mode, args.task)
    scorers, spn = evaluate_plan.load_scorers(args.head, args.spn, model, backbone, layers, args.task, args.oracle)
    strategies = evaluate_plan.strategy_list(args.strategies, scorers)
    llf = LLF_CHOICES[args.llf or ("full" if args.preset == "paper" else "on")]
    plan = Plan(task=args.task, strategies=strategies, ratios=ratios, layers=layers, mode=mode, llf=llf, scorers=scorers, spn=spn,
                prop_attn={"auto": "auto", "on": True, "off": False}[args.prop_attn], selection=args.selection,
                batch_size=args.batch_size, preset=args.preset, recovery=args.recovery)
    check_plan(plan, backbone)
    if not args.no_timing:
        warn_if_busy(args)  # every option checked: the run starts
    image_sets = [s.load() for s in images.seed_sets(backbone.preprocess, args.num_images, args.seeds)]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run_quality(backbone, image_sets, plan, progress=not args.quiet)
    if not args.no_timing:
        timed = evaluate_plan.strategy_list(args.time_strategies, scorers) if args.time_strategies else strategies
        result["cost"] = run_cost(backbone, image_sets[0]["images"], plan, time_batches, args.time_repeats, timed, progress=not args.quiet)
    result["command"] = args.command_line
    result["model"] = backbone.name
    write_json(result, out / "results.json")
    tables = "\n".join(markdown_table(result, key) for key in result["tables"])
    write_text(tables, out / "table.md")
    plot_quality(result, out / "quality.png")
    print(tables)
    info_line(f"wrote {out / 'results.json'}, {out / 'table.md'}, {out / 'quality.png'}")
    if args.results_page:
        from pullback_ext.results_pages import publish_command_results

        info_line("wrote", *publish_command_results(result, args.results_page, f"Token reduction quality: {backbone.name}", _page_body,
                                                  args.command_line, args.allow_dirty))
    return 0


def _page_body(result: dict) -> str:
    """The plain evaluation's results page: every quality table, then the FLOP table when costs were measured."""
    from pullback_ext.comparison.evaluation import flop_table, markdown_table

    parts = [markdown_table(result, key) for key in result["tables"]]
    if "cost" in result:
        parts.append(flop_table(result["cost"]))
    return "\n".join(parts)


def _check_timing(args: argparse.Namespace) -> None:
    """Fill in ``--time-repeats`` (3, or :data:`~pullback_ext.comparison.pareto.TIME_REPEATS` with
    ``--pareto``) and refuse, before any forward pass, a page that could not be published: a
    ``--pareto`` page timed in fewer rounds, or a page from a checkout with local changes without
    ``--allow-dirty``."""
    from pullback_ext.comparison.pareto import TIME_REPEATS
    from pullback_ext.errors import PullbackError
    from pullback_ext.results_pages import refuse_dirty

    if args.time_repeats is None:
        args.time_repeats = TIME_REPEATS if args.pareto else 3
    if not args.results_page:
        return
    if args.pareto and not args.no_timing and args.time_repeats < TIME_REPEATS:
        raise PullbackError(f"--time-repeats {args.time_repeats}: a --pareto results page gives every speed-up a bootstrap "
                            f"interval over at least {TIME_REPEATS} interleaved rounds; give --time-repeats {TIME_REPEATS} or "
                            "more, or --no-timing for a page on the FLOP axis alone")
    refuse_dirty(args.allow_dirty)


def _run_pareto(args: argparse.Namespace, backbone, model, images) -> int:
    from pathlib import Path

    import torch

    from pullback_ext.commands import evaluate_pareto
    from pullback_ext.comparison import pareto_report
    from pullback_ext.comparison.report import write_json, write_text

    device = evaluate_pareto.device(args.device)
    model.to(device)
    sets = images.seed_sets(backbone.preprocess, args.num_images, args.seeds)
    loaded = [s.load() for s in sets]
    pixels = torch.cat([d["images"] for d in loaded]).to(device)
    names = [name for s in sets for name in s.names()]
    classes = torch.cat([d["classes"] for d in loaded]).to(device) if all("classes" in d for d in loaded) else None
    result = evaluate_pareto.run(args, backbone, model, pixels, names, classes)
    result |= {"command": args.command_line, "model": backbone.name, "images": images.spec}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(result, out / "pareto.json")
    text = pareto_report.markdown(result)
    write_text(text, out / "pareto.md")
    pareto_report.plot(result, out / "pareto.png")
    print(pareto_report.matched_tables(result))
    info_line(f"wrote {out / 'pareto.json'}, {out / 'pareto.md'}, {out / 'pareto.png'}")
    if args.results_page:
        from pullback_ext.results_pages import page_location, publish_command_results

        folder, name = page_location(args.results_page)
        plot = pareto_report.plot(result, Path(folder) / f"{name}.png")
        title = f"Matched-cost comparison: {backbone.name}, {args.task}, {images.spec}"
        info_line("wrote", plot, *publish_command_results(result, args.results_page, title, pareto_report.page_renderer(plot.name),
                                                        args.command_line, args.allow_dirty))
    return 0
