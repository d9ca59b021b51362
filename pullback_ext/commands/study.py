"""``pullback study KIND``: one measurement swept over the layers of a model (docs/studies.md).

KIND: ``diagnose`` (the tractability diagnostic per layer and decoder), ``subspace``
(Geosubprobe: a per-token linear probe's quality on its top-k singular subspace, several models
and on the demo its fitted depth and segmentation probes side by side) or ``criteria``
(training-free pruning criteria at one layer at a time, per task, with the dense recovery
endpoints). Each finished layer is one JSON unit under ``--out``, so a
killed sweep continues with ``--resume``; under ``torchrun`` the images are shared over ranks.
Writes DIR/study.json (every per-image figure), DIR/study.png and DIR/table.md.
"""

from __future__ import annotations

import argparse

KINDS = ("diagnose", "subspace", "criteria")
# what a study writes in --out: its report and its per-layer units (subspace: one folder per model)
OUTPUTS = ("study.json", "study.png", "table.md", "layers/layer-*.json", "*/layers/layer-*.json")
# how long the defaults take: an estimate from one image per decoder timed at layers 0 and 7 of the demo model (and
# a 2-layer run at --output-size 4), one torch thread on a 2-core machine running another job
DIAGNOSE_TIME = (
    "How long (an estimate): with the defaults the demo's depth decoder is diagnosed at its full 112×112 output "
    "(M = 12544, stochastic trace and randomized SVD): one image took 100 s at layer 7 to 475 s at layer 0 on a 2-core "
    "machine (one torch thread, another job running), the cls and probe decoders a few seconds (plus 10-20 s per layer "
    "to fit the probe), so --layers all --num-images 4 takes about 2 hours. --output-size 4 (M = 16, as in "
    "docs/results/study-diagnose-demo.md) brings the depth decoder to about a second per image and the same study to "
    "about 5 minutes. Progress counts each image under each decoder.")
# options that say how the run goes, not what it measures: a resumed sweep may change them
RUN_OPTIONS = ("out", "resume", "overwrite", "quiet", "threads", "results_page", "command_line", "command", "_module", "layers",
               "batch_size", "chunk_size")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pullback_ext.commands.arguments import IMAGES_HELP, add_overwrite_argument, positive_int
    from pullback_ext.comparison.tasks import DENSE, TASKS
    from pullback_ext.results_pages import ALLOW_DIRTY_HELP
    from pullback_ext.studies.models import STUDY_GRAMMAR

    parser.add_argument("kind", choices=KINDS, help="what to sweep over the layers")
    src = parser.add_argument_group("model, images, layers")
    src.add_argument("--model", action="append", metavar="SPEC", help=f"{STUDY_GRAMMAR} (demo:random: the demo architecture, "
                     "untrained); subspace: repeat to compare models side by side")
    src.add_argument("--weights", metavar="FILE", help="local model weights (one --model only)")
    src.add_argument("--img-size", type=positive_int, default=None, help="timm models: build for this input size")
    src.add_argument("--images", metavar="PATH|builtin:NAME", help=IMAGES_HELP)
    src.add_argument("--num-images", type=positive_int, default=16, help="images per layer (criteria: per seed) (default 16)")
    src.add_argument("--layers", default="all", help="all, or a comma list of 0-based blocks whose output is studied")
    _add_diagnose_arguments(parser.add_argument_group("study diagnose", DIAGNOSE_TIME))
    sub = parser.add_argument_group("study subspace")
    sub.add_argument("--probe-targets", metavar="FILE", help="per-token targets [num_images, N, C] (.npy or safetensors), "
                     "aligned with the sorted image list (default on the demo: the probes of --fitted-probes)")
    sub.add_argument("--fitted-probes", default=None, help="demo without --probe-targets: comma list of the probes fitted on rendered "
                     "scenes, each swept beside the others: depth (log-depth of each patch's 2×2 quadrants), segmentation "
                     "(each patch's fraction of pixels of each of the 11 classes) (default depth)")
    crit = parser.add_argument_group("study criteria")
    crit.add_argument("--tasks", default=None, help=f"comma list of {', '.join(TASKS)} (default: the model's tasks; on the demo "
                      "cls and depth, segmentation with its shipped segmentation head when named)")
    crit.add_argument("--criteria", default=None, help="comma list of single-stage criteria (default: every training-free "
                      "one, plus importance with --head and oracle with --oracle)")
    crit.add_argument("--ratio", type=float, default=0.3, help="prune ratio η of every cell (default 0.3)")
    crit.add_argument("--alphas", default="0,0.25,0.5,0.75,1", help=f"dense tasks ({', '.join(DENSE)}): recovery endpoints α "
                      "(default 0,0.25,0.5,0.75,1)")
    crit.add_argument("--head", help="importance head checkpoint (enables the criterion importance)")
    crit.add_argument("--oracle", action="store_true", help="add the imp* oracle (--model demo; slow)")
    crit.add_argument("--seeds", type=positive_int, default=1, help="image sets (and random-criterion seeds) (default 1)")
    run = parser.add_argument_group("run")
    run.add_argument("--seed", type=int, default=0, help="random streams (diagnose: image i from (seed, i); demo:random's weights)")
    run.add_argument("--batch-size", type=positive_int, default=8, help="images per forward batch")
    run.add_argument("--out", required=True, help="output folder (layers/layer-NN.json, study.json, study.png, table.md)")
    run.add_argument("--resume", action="store_true", help="continue a killed sweep in --out: finished layers are read back")
    add_overwrite_argument(run)
    run.add_argument("--results-page", default=None, metavar="NAME",
                     help="also publish the results as docs/results/NAME.json, NAME.md and NAME.png (or DIR/NAME: into DIR)")
    run.add_argument("--allow-dirty", action="store_true", help=ALLOW_DIRTY_HELP)


def _add_diagnose_arguments(group) -> None:
    from pullback_ext.commands.arguments import positive_int

    group.add_argument("--decoders", default=None, help="comma list of diagnose decoders, plus probe (demo: the per-token "
                       "depth probe fitted at each layer) (default: demo cls,depth,probe; otherwise cls)")
    group.add_argument("--output-size", type=positive_int, default=None,
                       help="resize dense outputs to S×S (M = S²) (default the full output: the demo's depth map is 112×112, "
                            "minutes per image; see above)")
    group.add_argument("--rank", type=int, default=20, help="r: captured subspace for κ_cap(r), CV")
    group.add_argument("--kappa-ranks", default="1,2,5,10,20", help="also report κ_cap at these r (default 1,2,5,10,20)")
    group.add_argument("--oversample", type=int, default=10, help="randomized-SVD oversampling p")
    group.add_argument("--power", type=int, default=2, help="q power rounds")
    group.add_argument("--adaptive-tol", type=float, default=None, help="stop power rounds when the subspace defect is below this")
    group.add_argument("--probes", type=int, default=100, help="m probes (stochastic trace, SLQ)")
    group.add_argument("--slq-steps", type=int, default=30, help="Lanczos steps for r_eff^SLQ (0 skips it)")
    group.add_argument("--trace", default="auto", choices=["auto", "exact", "hutchinson", "hutch++", "xnystrace"])
    group.add_argument("--svd", default="auto", choices=["auto", "randomized", "dense"])
    group.add_argument("--chunk-size", type=int, default=32, help="tangents per vmap call (bounds memory)")
    group.add_argument("--kappa-threshold", type=float, default=0.9, help="regimes: κ_cap(r) at or above is low rank")
    group.add_argument("--cv-threshold", type=float, default=1.0, help="regimes: CV at or above is localised")
    group.add_argument("--dtype", default="float32", choices=["float32", "float64"])


def settings_of(args: argparse.Namespace, **extra) -> dict:
    """What identifies a study (a resumed sweep must match it): every option but the run options."""
    return {k: v for k, v in vars(args).items() if k not in RUN_OPTIONS} | extra


def run(args: argparse.Namespace) -> int:
    from pullback_ext.commands.arguments import results_folder
    from pullback_ext.errors import PullbackError
    from pullback_ext.studies.models import parse_study_model

    if not args.model:
        raise PullbackError("--model: required (demo | timm:NAME | hf:DIR | demo:random)")
    models = [parse_study_model(m) for m in args.model]
    if len(models) > 1 and args.kind != "subspace":
        raise PullbackError(f"--model: study {args.kind} takes one model; only study subspace compares several")
    if args.weights is not None and len(models) > 1:
        raise PullbackError("--weights: applies to one --model; give one model with its weights")
    if args.results_page:
        from pullback_ext.results_pages import refuse_dirty

        refuse_dirty(args.allow_dirty)
    out = results_folder(args, OUTPUTS, "a study", resumable=True)
    result = {"diagnose": _diagnose, "subspace": _subspace, "criteria": _criteria}[args.kind](args, models, out)
    if result is None:  # a torchrun rank other than 0
        return 0
    _report(args, result, out)
    return 0


def _sweep(args, store, layers, study, desc: str):
    from pullback_ext.studies.engine import run_sweep

    units = run_sweep(store, layers, study.work(), study.measure, study.finish, resume=args.resume, overwrite=args.overwrite,
                      progress=not args.quiet, desc=desc, steps=getattr(study, "steps", None),
                      unit=getattr(study, "step_unit", "layer"))
    return None if units is None else {str(layer): unit for layer, unit in units.items()}


def _images(args, model):
    from pullback_ext.commands.arguments import image_source

    return image_source(argparse.Namespace(images=args.images, num_images=args.num_images), model.spec)


def _diagnose(args, models, out) -> dict | None:
    import torch

    from pullback_ext.commands.arguments import comma_ints
    from pullback_ext.commands.diagnose import diagnose_config
    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.errors import PullbackError
    from pullback_ext.sources.probe_setup import build_probe_setup
    from pullback_ext.studies import diagnose_study as ds
    from pullback_ext.studies.engine import UnitStore
    from pullback_ext.studies.layers import parse_layers
    from pullback_ext.studies.models import study_weights

    (model,) = models
    weights = study_weights(model, args.weights, args.seed, out)  # demo:random: its initialisation as a file
    config = diagnose_config(args)
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    demo = model.spec.kind == "demo"
    decoders = tuple(d.strip() for d in (args.decoders or ("cls,depth,probe" if demo else "cls")).split(",") if d.strip())
    if ds.FIT_DECODER in decoders and not demo:
        raise PullbackError("--decoders: probe (the fitted per-token depth probe) needs --model demo; give linear:FILE otherwise")
    backbone, net = load_backbone(model.spec, weights)
    layers = parse_layers(args.layers, 0, backbone.depth - 1)

    def setup(layer: int, decoder: str):
        if decoder == ds.FIT_DECODER:
            decoder = f"linear:{ds.fitted_probe_file(net, layer, out / 'probes')}"
        return build_probe_setup(model.spec, weights, layer, decoder, args.output_size, args.img_size, dtype)

    checked = [setup(layers[0], "cls" if d == ds.FIT_DECODER else d) for d in decoders]  # bad decoders fail before the sweep
    config.check_rank(checked[0].probe.ambient_dim)
    source = _images(args, model)
    image_set = source.heldout(checked[0].preprocess, args.num_images, partial=True)
    study = ds.DiagnoseStudy(setup, image_set, decoders, config, dtype, args.batch_size, comma_ints(args.kappa_ranks, "--kappa-ranks"))
    units = _sweep(args, UnitStore(out, "diagnose", settings_of(args, decoders=list(decoders))), layers, study, "study diagnose")
    if units is None:
        return None
    return {"kind": "diagnose", "model": str(model), "images": source.spec, "files": image_set.names(), "layers": list(layers),
            "decoders": list(decoders), "settings": settings_of(args), "summary": ds.summary({int(k): v for k, v in units.items()}, decoders),
            "units": units}


def _slug(model) -> str:
    return str(model).replace(":", "-").replace("/", "_")


def _subspace(args, models, out) -> dict | None:
    from pullback_ext.errors import PullbackError
    from pullback_ext.studies import subspace_study as ss
    from pullback_ext.studies.engine import UnitStore
    from pullback_ext.studies.layers import parse_layers
    from pullback_ext.studies.models import load_study_backbone

    probes = _fitted_probes(args.fitted_probes, args.probe_targets)
    loaded = [load_study_backbone(model, args.weights, args.seed) for model in models]
    plans = [parse_layers(args.layers, 0, backbone.depth - 1) for backbone, _ in loaded]  # every model's layers, checked first
    result = {"kind": "subspace", "settings": settings_of(args), "models": {}}
    for model, (backbone, net), layers in zip(models, loaded, plans):
        source = _images(args, model)
        data = source.heldout(backbone.preprocess, args.num_images, partial=True).load()
        if args.probe_targets is not None:
            num_patch = backbone.block_tokens(data["images"][:1], 0).shape[1]
            fits = {None: ss.read_targets(args.probe_targets, data["images"].shape[0], num_patch, backbone.num_prefix)}
        elif backbone.name == "demo":
            fits = {probe: ss.demo_targets(net, probe, data) for probe in probes}
        else:
            raise PullbackError(f"--probe-targets: required with --model {model} (only the demo fits its probes on rendered scenes)")
        for probe, targets in fits.items():
            # the depth probe (or the user's) keeps the model's name; another probe is named beside it
            name, folder = str(model), _slug(model)
            if probe not in (None, "depth"):
                name, folder = f"{model} ({probe} probe)", f"{folder}-{probe}"
            study = ss.SubspaceStudy(backbone, net, data["images"], targets, probe, args.seed, batch_size=args.batch_size)
            store = UnitStore(out / folder, "subspace", settings_of(args, model=str(model), fitted_probes=probe))
            units = _sweep(args, store, layers, study, f"study subspace {name}")
            if units is None:
                continue
            result["images"] = source.spec
            quality = ("fidelity (R² vs unprojected)" if targets is None else
                       "R² vs class fractions" if probe == "segmentation" else "R² vs targets")
            result["models"][name] = {"layers": list(layers), "units": units, "summary": ss.summary(units),
                                      "probe": probe or "targets", "quality_name": quality}
    return result if result["models"] else None


def _fitted_probes(text: str | None, probe_targets: str | None) -> tuple:
    """The demo's fitted probes of ``--fitted-probes`` (default depth); refused beside ``--probe-targets``."""
    from pullback_ext.errors import PullbackError
    from pullback_ext.studies.subspace_study import DEMO_PROBES

    if text is None:
        return ("depth",)
    if probe_targets is not None:
        raise PullbackError("--fitted-probes: the demo's probes fitted on rendered scenes; with --probe-targets the probe is fitted "
                            "on those targets, so give one of the two")
    probes = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not probes or any(p not in DEMO_PROBES for p in probes):
        raise PullbackError(f"--fitted-probes: expected a comma list of {', '.join(DEMO_PROBES)}; got {text!r}")
    return probes


def _criteria(args, models, out) -> dict | None:
    from pullback_ext.commands import evaluate_plan
    from pullback_ext.commands.arguments import comma_floats
    from pullback_ext.comparison.evaluation import check_plan
    from pullback_ext.errors import PullbackError
    from pullback_ext.studies import criteria_study as cs
    from pullback_ext.studies.engine import UnitStore
    from pullback_ext.studies.layers import parse_layers
    from pullback_ext.studies.models import load_study_backbone

    (model,) = models
    named = _tasks(args.tasks)
    backbone, net = load_study_backbone(model, args.weights, args.seed, "segmentation" if named and "segmentation" in named else None)
    tasks = named or backbone.tasks
    for task in tasks:
        if task not in backbone.tasks:
            raise PullbackError(f"--tasks: {task!r} needs a model with that decoder; {model} supports {', '.join(backbone.tasks)}")
    layers = parse_layers(args.layers, 0, cs.eligible_last(backbone.depth, tasks))
    available = {name: None for name, given in (("importance", args.head), ("oracle", args.oracle)) if given}
    criteria = evaluate_plan.strategy_list(args.criteria, available)
    cache: dict = {}

    def scorers(task: str, stage: int) -> dict:
        if available and (task, stage) not in cache:
            cache[task, stage] = evaluate_plan.load_scorers(args.head, None, net, backbone, (stage,), task, args.oracle)[0]
        return cache.get((task, stage), {})

    alphas = comma_floats(args.alphas, "--alphas") if any(cs.recovers(task) for task in tasks) else ()
    if any(not 0 <= a <= 1 for a in alphas):
        raise PullbackError(f"--alphas: every α must lie in [0, 1]; got {args.alphas!r}")
    sets = [s.load() for s in _images(args, model).seed_sets(backbone.preprocess, args.num_images, args.seeds)]
    study = cs.CriteriaStudy(backbone, sets, tasks, criteria, args.ratio, alphas, args.batch_size, scorers)
    for task in tasks:
        check_plan(study.plan(task, layers[0]), backbone)
    units = _sweep(args, UnitStore(out, "criteria", settings_of(args)), layers, study, "study criteria")
    if units is None:
        return None
    return {"kind": "criteria", "model": str(model), "images": args.images or "builtin:scenes", "tasks": list(tasks),
            "criteria": list(criteria), "layers": list(layers), "settings": settings_of(args),
            "summary": cs.summary(units, tasks, criteria), "units": units}


def _tasks(text: str | None) -> tuple | None:
    """The tasks of ``--tasks`` (None when not given), each a name of the task table."""
    from pullback_ext.comparison.tasks import TASKS
    from pullback_ext.errors import PullbackError

    if text is None:
        return None
    tasks = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not tasks:
        raise PullbackError(f"--tasks: no task named in {text!r}; choose from {', '.join(TASKS)}")
    for task in tasks:
        if task not in TASKS:
            raise PullbackError(f"--tasks: unknown task {task!r} in {text!r}; choose from {', '.join(TASKS)}")
    return tasks


TITLES = {"diagnose": "Layer study: the diagnostic against depth", "subspace": "Layer study: probe subspaces against depth (Geosubprobe)",
          "criteria": "Layer study: pruning criteria one layer at a time"}


def _report(args, result: dict, out) -> None:
    from pathlib import Path

    from pullback_ext.fileio import atomic_write_json, atomic_write_text
    from pullback_ext.studies import figures, pages

    result["command"] = args.command_line
    plot = {"diagnose": figures.plot_diagnose_study, "subspace": figures.plot_subspace_study,
            "criteria": figures.plot_criteria_study}[args.kind]
    atomic_write_json(out / "study.json", result, indent=1)
    plot(result, out / "study.png")
    text = pages.render(result)
    atomic_write_text(out / "table.md", text + "\n")
    print(text)
    print(f"wrote {out / 'study.json'}, {out / 'study.png'}, {out / 'table.md'}")
    if args.results_page:
        from pullback_ext.results_pages import page_location, publish_command_results

        folder, name = page_location(args.results_page)
        picture = plot(result, Path(folder) / f"{name}.png")
        print("wrote", picture, *publish_command_results(pages.published(result), args.results_page, TITLES[args.kind],
                                                          lambda r: pages.render(r, picture.name), args.command_line,
                                                          args.allow_dirty))
