"""``pullback evaluate --pareto``: every method swept over its own knob, compared at matched cost.

A sweep is ``METHOD:FIELD=v1,v2`` (a :class:`~pullback_ext.prune.reduction_options.ReductionOptions`
field and its values); a method's grid is the product of its fields' values. The defaults below
suit the demo model (196 patch tokens, 8 blocks) and are not scaled to other models; ``--sweep``
replaces one field of one method. ``--tap DIR[,DIR]`` adds one row per TAP checkpoint swept over the
keep rate ρ (:data:`TAP_RHOS`, η = 1 − ρ; ``--sweep tap:ratio=η1,η2`` replaces them), and beside it a
one-point row at ρ = 1: what the register, and TAP-J's adapted backbone, cost in quality with nothing
removed. A method whose head is optional (``importance_tome``) also sweeps ``head=trained,none``: the
``--head`` checkpoint, or no head; each gives its own row. A method with more knobs than the one a
user sets (``importance_tome``: ``r``; its ``schedule`` and ``early_merges`` follow from it) adds a
row of its defaults, swept over that knob alone.
"""

from __future__ import annotations

import argparse
import itertools

from pullback_ext.errors import PullbackError

DEFAULT_METHODS = ("importance", "tome", "evit", "random")
HEAD_CHOICES = ("trained", "none")  # the values of --sweep METHOD:head=...
TAP_RHOS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)  # keep rates of every --tap checkpoint


def parse_sweeps(texts) -> dict:
    """``{method: {field: values}}`` from the ``METHOD:FIELD=v1,v2`` of ``texts``: the fields they
    replace in the method grids (:func:`method_grid`)."""
    from pullback_ext.commands.arguments import option_value
    from pullback_ext.prune.reduction_options import option_names

    fields = (set(option_names()) - {"spn", "strategy"}) | {"head"}
    given: dict = {}
    for text in texts or ():
        method, sep, rest = text.partition(":")
        name, eq, values = rest.partition("=")
        if not (sep and eq and method and values):
            raise PullbackError(f"--sweep: expected METHOD:FIELD=v1,v2 (e.g. tome:r=4,8,16); got {text!r}")
        if name not in fields:
            raise PullbackError(f"--sweep {text}: {name!r} is not a reduction option; choose from {', '.join(sorted(fields))}")
        values = tuple(v.strip() for v in values.split(",") if v.strip())
        if name == "head" and not set(values) <= set(HEAD_CHOICES):
            raise PullbackError(f"--sweep {text}: head takes {' or '.join(HEAD_CHOICES)} (the --head checkpoint, or no head); "
                                f"got {', '.join(v for v in values if v not in HEAD_CHOICES)}")
        given.setdefault(method, {})[name] = values if name == "head" else tuple(option_value(v) for v in values)
    return given


def method_grid(method: str, mode: str, ratios: tuple, given: dict) -> dict:
    """The fields and values method ``method`` is swept over: its own default sweep
    (:meth:`~pullback_ext.prune.methods.base.Method.sweep_grid`) with ``given`` replacing fields."""
    from pullback_ext.prune import methods

    grid = methods.get(method).sweep_grid(mode, ratios) | given.get(method, {})
    if not grid:
        raise PullbackError(f"--sweep: method {method!r} has no default sweep; give one with --sweep {method}:FIELD=v1,v2")
    return grid


def method_grids(method: str, mode: str, ratios: tuple, given: dict) -> list:
    """The grids of method ``method``'s rows: :func:`method_grid`, then, for a method with a
    ``defaults_sweep``, that grid (its fields and ``head`` taken from ``given``): the method with every
    other option at its default. That row is left out when ``given`` sets another field: the sweep
    the user asked for is then the only one."""
    from pullback_ext.prune import methods

    grids = [method_grid(method, mode, ratios, given)]
    defaults, own = methods.get(method).defaults_sweep, given.get(method, {})
    if defaults and set(own) <= set(defaults) | {"head"}:
        grids.append(defaults | own)
    return grids


def build_points(methods: tuple, given: dict, base: dict, scorers: dict, spn, ratios: tuple) -> list:
    """:class:`~pullback_ext.comparison.pareto.Point` s of every method's grid. ``base``: the options the
    single-stage methods share (``layers``, ``mode``, ``preset``)."""
    from pullback_ext.prune import methods as registry
    from pullback_ext.comparison.pareto import Point
    from pullback_ext.prune.reduction_options import ReductionOptions

    unknown = sorted(set(given) - set(methods))
    if unknown:
        raise PullbackError(f"--sweep names {', '.join(unknown)}, which --methods does not include")
    points = []
    unknown = [m for m in methods if m not in registry.names()]
    if unknown:
        raise PullbackError(f"--methods: unknown method {unknown[0]!r}; choose from {', '.join(registry.names())}")
    for method in methods:
        m = registry.get(method)
        if m.head_from is not None and m.head_from not in scorers and not m.head_optional:
            needed = (f"--trained {method}=DIR (a folder of {m.trained_by})" if m.trained_by else
                      "--oracle" if m.head_from == "oracle" else "--head CKPT")
            raise PullbackError(f"--methods: {method!r} needs {needed}")
        fixed = m.sweep_base(base)
        if m.head_from in scorers:
            fixed["head"] = scorers[m.head_from]
            if spn is not None and base["mode"] == "merge" and "spn" in m.takes:
                fixed["spn"] = spn
        trained = fixed.pop("head", None)
        for grid in method_grids(method, base["mode"], ratios, given):
            heads = _swept_heads(method, m, grid, trained)
            for combo in itertools.product(*grid.values()):
                knob = dict(zip(grid, combo))
                head = heads[knob.get("head", "trained")]
                try:
                    options = ReductionOptions(strategy=method, **fixed, **{**knob, "head": head})
                except PullbackError as exc:
                    raise PullbackError(f"--sweep {method}: {exc}") from None
                points.append(Point(options=options, knob=knob))
    return points


def _swept_heads(method: str, m, grid: dict, trained) -> dict:
    """``{choice: head}`` of the ``head`` values ``grid`` sweeps (checked: the method's head must be
    optional, and ``trained`` needs a loaded ``--head``); ``{"trained": trained}`` when it sweeps none."""
    if "head" not in grid:
        return {"trained": trained}
    if not m.head_optional:
        raise PullbackError(f"--sweep {method}:head: {method!r} always takes its head; only a method that runs "
                            f"without one sweeps it")
    if "trained" in grid["head"] and trained is None:
        raise PullbackError(f"--sweep {method}:head=trained needs --head CKPT")
    return {"trained": trained, "none": None}


def load_taps(text: str, backbone, model, task: str) -> list:
    """``[(name, TaskRegister)]`` from the comma list of TAP checkpoint folders ``text`` (``--tap``),
    each checked to serve ``task`` on ``backbone`` (of ``model``: the demo model, a timm
    VisionTransformer or a Hugging Face model) and to fit it; ``name`` is the folder's own name, or
    the folder as given where two share one."""
    from pathlib import Path

    from pullback_ext.tap.checkpoint import load_register
    from pullback_ext.prune.methods.tap import check_model
    from pullback_ext.tap_training.training import layer_layout

    folders = [f.strip() for f in text.split(",") if f.strip()]
    if not folders:
        raise PullbackError(f"--tap: expected TAP checkpoint folders (a comma list); got {text!r}")
    blocks, _ = layer_layout(model, backbone)
    names = [Path(folder).name or folder for folder in folders]
    names = names if len(set(names)) == len(names) else folders  # rows must not share a label
    taps = []
    for folder, name in zip(folders, names):
        register = load_register(folder)
        if register.task != task:
            raise PullbackError(f"--tap {folder}: that register serves task {register.task!r}, but --task is {task!r}")
        try:
            check_model(register, blocks, backbone.features_dim)
        except PullbackError as exc:
            raise PullbackError(f"--tap {folder}: {exc}") from None
        taps.append((name, register))
    return taps


def tap_points(taps, ratios: tuple = tuple(round(1.0 - rho, 10) for rho in TAP_RHOS)) -> list:
    """Per ``(name, register)`` of ``taps``: its row at every η of ``ratios`` (``knob`` ρ = 1 − η), then
    its one-point row at ρ = 1 (nothing removed: the register alone, or TAP-J's adapted backbone)."""
    from pullback_ext.comparison.pareto import Point
    from pullback_ext.prune.methods.tap import TAP, tap_row
    from pullback_ext.prune.reduction_options import ReductionOptions

    points = []
    for name, register in taps:
        for ratio in (*ratios, 0.0):
            options = ReductionOptions(strategy=TAP.name, head=register, ratio=float(ratio))
            points.append(Point(options=options, knob={"rho": round(1.0 - ratio, 10)}, row=tap_row(register, name, ratio == 0.0)))
    return points


def _tap_ratios(given: dict):
    """The η values of ``--sweep tap:ratio=...`` (removed from ``given``), or None."""
    tap = given.pop("tap", {})
    if set(tap) - {"ratio"}:
        raise PullbackError(f"--sweep tap: only ratio (η = 1 − ρ) is swept for TAP; got {', '.join(sorted(tap))}")
    ratios = tap.get("ratio")
    if ratios is not None and not all(isinstance(r, float) and 0.0 < r < 1.0 for r in ratios):
        raise PullbackError(f"--sweep tap:ratio: expected fractions η in (0, 1); got {list(ratios)}")
    return ratios


def run(args: argparse.Namespace, backbone, model, images, names: list, classes=None) -> dict:
    """Quality and cost of every point on ``images [n, 3, H, W]`` (``names``: one per image) for
    ``backbone`` (``model``: the module it wraps, which the scorer checkpoints are checked against).
    The primary metric of the task gives the matched tables; its other metrics are summarised per
    point (``other_errors``), and with ``classes [n, H, W]`` (rendered scenes) a segmentation run
    adds each point's ``label_miou`` and the unpruned model's."""
    from pullback_ext.commands import evaluate_plan
    from pullback_ext.commands.arguments import comma_floats, comma_ints, warn_if_busy
    from pullback_ext.prune import row_rules
    from pullback_ext.comparison import pareto
    from pullback_ext.comparison.evaluation import METRICS, PRIMARY
    from pullback_ext.comparison.tasks import resolve_mode

    ratios = comma_floats(args.ratios, "--ratios")
    layers = evaluate_plan.reduction_layers(args, backbone.depth)
    mode = resolve_mode(args.mode, args.task)
    scorers, spn = evaluate_plan.load_scorers(args.head, args.spn, model, backbone, layers, args.task, False)
    scorers = {name: _on(s, images.device) for name, s in scorers.items()}
    spn = None if spn is None else spn.to(images.device)
    methods = tuple(m.strip() for m in (args.methods or _default_methods(scorers)).split(",") if m.strip())
    scorers |= {name: module.to(images.device) for name, module in load_trained(args.trained, methods).items()}
    given = parse_sweeps(args.sweep)
    tap_ratios = _tap_ratios(given)
    if tap_ratios is not None and args.tap is None:
        raise PullbackError("--sweep tap:ratio=... needs --tap DIR (the TAP checkpoints to sweep)")
    points = build_points(methods, given, {"layers": layers, "mode": mode, "preset": args.preset}, scorers, spn, ratios)
    if args.tap is not None:
        taps = [(name, register.to(images.device)) for name, register in load_taps(args.tap, backbone, model, args.task)]
        points += tap_points(taps, *(() if tap_ratios is None else (tap_ratios,)))
    reductions = [pareto.resolve(p.options, backbone) for p in points]  # every point checked before any forward pass
    labels = [p.row or row_rules.row_label(r) for p, r in zip(points, reductions)]
    metric = PRIMARY[args.task]
    batches = () if args.no_timing else comma_ints(args.time_batches, "--time-batches")
    if batches:
        warn_if_busy(args)  # every option checked: the run starts
    measured = pareto.image_errors(backbone, images, points, args.task, args.batch_size, not args.quiet, classes)
    cost = pareto.measure_cost(backbone, images, points, args.task, batches, args.time_repeats, not args.quiet)
    etas = [None if backbone.eta is None else backbone.eta(p.options) for p in points]
    others = METRICS[args.task][1:]
    extra = [{"other_errors": {m: pareto.error_summary(e[m]) for m in others}}
             | ({"label_miou": e["label_miou"]} if "label_miou" in e else {}) for e in measured]
    result = pareto.summarise(points, labels, [e[metric] for e in measured], cost, etas, extra=extra)
    for p in result["points"]:
        for summary in (p["error"], *p["other_errors"].values()):
            summary["worst_image_name"] = names[summary["worst_image"]]
    if measured and "label_miou_unpruned" in measured[0]:
        result["label_miou_unpruned"] = measured[0]["label_miou_unpruned"]
    return result | {"metric": metric, "other_metrics": list(others), "task": args.task, "mode": mode, "layers": list(layers),
                     "preset": args.preset, "num_images": int(images.shape[0])}


def load_trained(texts, methods: tuple) -> dict:
    """``{head_from: module}`` of the ``METHOD=DIR`` of ``texts`` (``--trained``): each folder loaded
    as its method's ``head=`` (one row per method); the method must be among ``methods`` and trained
    by a command of its own."""
    from pullback_ext.prune import methods as registry

    loaded = {}
    for text in texts or ():
        method, sep, folder = text.partition("=")
        if not sep or not folder or method not in registry.names() or not registry.get(method).trained_by:
            trained = [m.name for m in registry.all_methods() if m.trained_by]
            raise PullbackError(f"--trained: expected METHOD=DIR with METHOD one of {', '.join(trained)}; got {text!r}")
        if method not in methods:
            raise PullbackError(f"--trained {method}: --methods does not include {method!r}")
        m = registry.get(method)
        if m.head_from in loaded:
            raise PullbackError(f"--trained {method}: given twice")
        loaded[m.head_from] = m.checked_head(folder, ())
    return loaded


def _default_methods(scorers: dict) -> str:
    from pullback_ext.prune import methods

    return ",".join(m for m in DEFAULT_METHODS if methods.get(m).head_from in (None, *scorers))


def device(text: str):
    """The ``torch.device`` of ``--device``, checked to exist on this machine."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise PullbackError(f"--device: expected cpu, cuda or cuda:N; got {text!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PullbackError(f"--device {text}: no CUDA device is available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise PullbackError(f"--device: expected cpu, cuda or cuda:N; got {text!r}")
    return dev


def _on(scorer, dev):
    """A scorer (a module, or one per stage) moved to ``dev``."""
    return [s.to(dev) for s in scorer] if isinstance(scorer, (list, tuple)) else scorer.to(dev)
