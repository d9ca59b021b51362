"""Matched-cost errors on the held-out photo crops, where importance_tome's defaults are chosen.

    python benchmarks/heldout_photos.py --task cls --methods tome,dtem --trained dtem=runs/dtem_cls \\
        --head runs/head_cls --head runs/head_cls_ft --out heldout-cls.json

The demo model on crops ``--first`` .. ``--first + --count - 1`` of ``builtin:photos`` (default
110–219: the pages measure 0–109), every method swept over the grid ``pullback evaluate --pareto``
gives it (its rows, labels and frontiers), and importance_tome (or the methods of ``--head-methods``)
once per ``--head`` (every setting of its sweep, and its defaults row, ``r`` alone; each head scoring
the block it was trained on). FLOP
ratios of the task's own forward, no timing. Prints mean / p95 / worst crop at each ``--targets``
ratio, matched on each row's frontier (``comparison.pareto.matched_error``); writes every point to
``--out`` (JSON, atomic), stamped with the machine, versions and command.

A candidate one-knob rule is read off the points a run measured rather than measured again:

    python benchmarks/heldout_photos.py --from cls-rule.json --rule 1.5,2,decreasing,decreasing \
        --rule 1.5,1.5,constant,constant --criterion-targets 1.1,1.25,1.5,2 --out cls-rules.json

``--rule GUARDED,EARLY,BETWEEN,BEYOND`` is ``importance_tome.rule_setting``, the family ``auto_setting`` is one of: at each
``r`` of a head's sweep, with ρ ToMe's own FLOP ratio at that ``r`` (``tome_reach(r, "constant")``),
the point measured with every merge guarded and the constant schedule while ρ ≤ GUARDED, every merge
guarded with schedule BETWEEN while ρ ≤ EARLY, and schedule BEYOND with ToMe's rule before the score
beyond. Its row is added per head, and the criterion of docs/importance_tome_findings.md §5 printed:
the geometric mean over ``--criterion-targets`` and mean / p95 / worst of the row's matched error
over ToMe's (lower is better; a target either row does not reach is left out).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without installing

STATISTICS = ("mean", "p95", "worst")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("cls", "depth"), default="cls")
    parser.add_argument("--methods", default="tome", help="comma list of methods without a head of ours (their pareto grids)")
    parser.add_argument("--trained", action="append", default=[], metavar="METHOD=DIR", help="as pullback evaluate --pareto")
    parser.add_argument("--head", action="append", default=[], metavar="DIR", help="an importance head: the rows of --head-methods with it")
    parser.add_argument("--head-methods", default="importance_tome", type=head_methods,
                        help="comma list of our methods whose rows each --head gives (default: importance_tome)")
    parser.add_argument("--sweep", action="append", default=[], metavar="METHOD:FIELD=V1,V2",
                        help="as pullback evaluate --pareto: replaces FIELD in METHOD's grid (those of --head-methods also in their rows per --head)")
    parser.add_argument("--ratios", default=None, help="the single-stage methods' ratios (default: the task's page values)")
    parser.add_argument("--targets", default="1.1,1.25,1.5,2,2.5,3", help="FLOP ratios to match at")
    parser.add_argument("--first", type=int, default=110, help="first crop (the pages measure 0-109)")
    parser.add_argument("--count", type=int, default=110, help="crops")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rule", action="append", default=[], type=parse_rule, metavar="GUARDED,EARLY,BETWEEN,BEYOND",
                        help="a candidate one-knob rule read off each head's points (see above)")
    parser.add_argument("--criterion-targets", default="1.1,1.25,1.5,2", help="FLOP ratios of the rules' criterion")
    parser.add_argument("--from", dest="source", default=None, metavar="JSON",
                        help="read the points of an earlier run's --out instead of measuring")
    parser.add_argument("--out", required=True, help="JSON of every point")
    return parser.parse_args(argv)


def head_methods(text: str) -> tuple:
    """``--head-methods``: names of methods that take an importance head and run without one too."""
    from pullback_ext.prune import methods

    names = tuple(m for m in text.split(",") if m)
    takers = [m.name for m in methods.all_methods() if m.head_from == "importance" and m.head_optional]
    wrong = [m for m in names if m not in takers]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(takers)}; got {text!r}")
    return names


def parse_rule(text: str) -> tuple[float, float, str, str]:
    """``"1.5,2,decreasing,decreasing"`` -> ``(1.5, 2.0, "decreasing", "decreasing")``."""
    parts = text.split(",")
    schedules = ("constant", "decreasing")
    try:
        guarded, early = float(parts[0]), float(parts[1])
    except (ValueError, IndexError):
        guarded = early = math.nan
    if len(parts) != 4 or not (1.0 <= guarded <= early) or parts[2] not in schedules or parts[3] not in schedules:
        raise argparse.ArgumentTypeError(f"--rule takes GUARDED,EARLY,BETWEEN,BEYOND with 1 <= GUARDED <= EARLY and "
                                         f"schedules in {schedules}; got {text!r}")
    return guarded, early, parts[2], parts[3]


def rule_rows(rows: dict, rules: list, shape) -> dict:
    """``{label: points}``: per head of ``rows`` (importance_tome's points with an explicit schedule and
    ``early_merges``, grouped by their ``head``: a folder name, or None for no head) and per rule, the
    point of the setting the rule picks at each ``r`` (an ``r`` whose point was not measured is left out,
    and a rule none of whose points was, too)."""
    from pullback_ext.prune.methods.importance_tome import rule_setting, tome_reach

    settings: dict = {}
    for points in rows.values():
        for p in points:
            knob = p["knob"]
            if "head" in p and {"r", "schedule", "early_merges"} <= set(knob):
                settings.setdefault(p["head"], {})[(knob["r"], knob["schedule"], bool(knob["early_merges"]))] = p
    out = {}
    for head, measured in settings.items():
        for rule in rules:
            picked = []
            for r in sorted({r for r, _, _ in measured}):
                found = measured.get((r, *rule_setting(tome_reach(r, "constant", shape), *rule)))
                if found is not None:
                    picked.append(found)
            if picked:
                out[f"{head or 'no head'}: rule ({rule[0]:g}, {rule[1]:g}; {rule[2]}, {rule[3]})"] = picked
    return out


def criterion(points: list, reference: list, targets: tuple) -> float:
    """Geometric mean over ``targets`` × mean / p95 / worst of ``points``' matched error over ``reference``'s
    (the targets both rows reach); NaN where none is."""
    from pullback_ext.comparison.pareto import matched_error

    logs = []
    for t in targets:
        for s in STATISTICS:
            ours, theirs = (matched_error([p["flop_ratio"] for p in row], [p["error"][s] for p in row], t)
                            for row in (points, reference))
            if ours is not None and theirs is not None and ours["value"] > 0 and theirs["value"] > 0:
                logs.append(math.log(ours["value"] / theirs["value"]))
    return math.exp(sum(logs) / len(logs)) if logs else math.nan


def rows_of(args: argparse.Namespace, backbone, model) -> tuple[list, list]:
    """``(points, row labels)``: the methods' pareto grids, then those of ``--head-methods`` per head."""
    from pullback_ext.commands.evaluate_pareto import build_points, load_trained, parse_sweeps
    from pullback_ext.commands.evaluate_plan import load_metric
    from pullback_ext.comparison import pareto
    from pullback_ext.prune import row_rules

    mode = "merge" if args.task == "cls" else "prune"
    ratios = tuple(float(v) for v in (args.ratios or ("0.1,0.2,0.3,0.4,0.5,0.6,0.7" if args.task == "cls" else
                                                         "0.1,0.2,0.3,0.5,0.7")).split(","))
    base = {"layers": (2,), "mode": mode, "preset": "recommended"}
    methods = tuple(m for m in args.methods.split(",") if m)
    given = parse_sweeps(args.sweep)
    points = build_points(methods, {m: g for m, g in given.items() if m in methods}, base, load_trained(args.trained, methods),
                          None, ratios)
    labels = [p.row or row_rules.row_label(pareto.resolve(p.options, backbone)) for p in points]
    names = [Path(folder).name for folder in args.head]
    for folder, name in zip(args.head, names):
        name = name if names.count(name) == 1 else folder  # two heads of one name: their rows stay apart
        head = load_metric(folder, backbone.features_dim)[0]
        own = {m: g for m, g in given.items() if m in args.head_methods}
        ours = [p for p in build_points(args.head_methods, own, base, {"importance": head}, None, ratios)
                if p.options.head is not None]
        points += ours
        labels += [f"{name}: {p.row or row_rules.row_label(pareto.resolve(p.options, backbone))}" for p in ours]
    return points, labels


def table(rows: dict, targets: tuple) -> str:
    from pullback_ext.comparison.pareto import matched_error

    lines = ["| row | " + " | ".join(f"{t:g}×" for t in targets) + " | fastest |", "|---" * (len(targets) + 2) + "|"]
    for label, points in rows.items():
        xs = [p["flop_ratio"] for p in points]
        cells = []
        for t in targets:
            found = [matched_error(xs, [p["error"][s] for p in points], t) for s in STATISTICS]
            cells.append(" / ".join("–" if e is None else f"{e['value']:.3g}" for e in found))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {max(xs):.2f}× |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch

    from pullback_ext.comparison.backbones import demo_backbone
    from pullback_ext.comparison.evaluation import PRIMARY
    from pullback_ext.fileio import atomic_write_json
    from pullback_ext.prune.methods.base import BackboneShape
    from pullback_ext.results_pages import stamp
    from pullback_ext.sources.models import ModelSpec, load_model

    args = parse(argv)
    torch.set_num_threads(args.threads)
    model = load_model(ModelSpec("demo"))[0].eval()
    backbone = demo_backbone(model)
    if args.source is None:
        rows, crops = measure(args, backbone, model), [args.first, args.first + args.count - 1]
    else:
        earlier = read_points(Path(args.source))
        args.task, rows, crops = earlier["task"], earlier["rows"], earlier["crops"]
    rows = {label: points for label, points in rows.items() if ": rule (" not in label}
    shape = BackboneShape(depth=backbone.depth, num_prefix=backbone.num_prefix, has_cls=backbone.has_cls,
                          num_patch=backbone.num_patches)
    rules = rule_rows(rows, args.rule, shape)
    if args.rule and not rules:
        from pullback_ext.errors import PullbackError

        raise PullbackError("--rule: no importance_tome points with an explicit schedule and early_merges to read it off "
                            "(measure them with --head or --methods importance_tome, its grid sweeps both)")
    rows.update(rules)
    targets = tuple(float(t) for t in args.targets.split(","))
    print(table(rows, targets))
    reference = next((points for label, points in rows.items() if label.startswith("tome")), None)
    if rules and reference is not None:
        judged = tuple(float(t) for t in args.criterion_targets.split(","))
        print(f"\n| rule | our matched mean, p95, worst over ToMe's at {', '.join(f'{t:g}×' for t in judged)} (geometric mean) |")
        print("|---|---|")
        for label, points in rules.items():
            print(f"| {label} | {criterion(points, reference, judged):.3g} |")
    atomic_write_json(Path(args.out), {"task": args.task, "crops": crops, "metric": PRIMARY[args.task], "rows": rows,
                                       **stamp(" ".join(sys.argv))})
    return 0


def measure(args: argparse.Namespace, backbone, model) -> dict:
    """``{label: points}``: every point of :func:`rows_of` on the crops, its FLOP ratio and error summary."""
    from pullback_ext.comparison import pareto
    from pullback_ext.comparison.evaluation import PRIMARY
    from pullback_ext.sources.photos import PhotoSource

    images = PhotoSource().heldout(backbone.preprocess, args.count, after=args.first).load()["images"]
    points, labels = rows_of(args, backbone, model)
    errors = [e[PRIMARY[args.task]] for e in pareto.image_errors(backbone, images, points, args.task, 16, True)]
    cost = pareto.measure_cost(backbone, images, points, args.task, (), 1, False)
    rows: dict = {}
    for label, point, e, c in zip(labels, points, errors, cost["points"]):
        entry = {"knob": {k: v for k, v in point.knob.items() if k != "head"}, "flop_ratio": c["flop_ratio"],
                 "error": pareto.error_summary(e)}
        if point.options.strategy == "importance_tome":  # which head's rule rows it may serve in (None: no head)
            entry["head"] = label.split(": ")[0] if point.options.head is not None else None
        rows.setdefault(label, []).append(entry)
    return rows


def read_points(path: Path) -> dict:
    """An earlier run's ``--out``, checked to hold what a rule is read from."""
    from pullback_ext.errors import PullbackError

    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise PullbackError(f"--from: cannot read {path} as the JSON of an earlier run ({error})") from None
    if not isinstance(earlier, dict) or not {"task", "rows", "crops"} <= set(earlier) or not isinstance(earlier["rows"], dict):
        raise PullbackError(f"--from: {path} is not the --out of this script (expected the keys task, rows and crops)")
    return earlier


if __name__ == "__main__":
    raise SystemExit(main())
