"""Matched-cost errors on the held-out photo crops, where importance_tome's defaults are chosen.

    python benchmarks/heldout_photos.py --task cls --methods tome,dtem --trained dtem=runs/dtem_cls \\
        --head runs/head_cls --head runs/head_cls_ft --out heldout-cls.json

The demo model on crops ``--first`` .. ``--first + --count - 1`` of ``builtin:photos`` (default
110–219: the pages measure 0–109), every method swept over the grid ``pullback evaluate --pareto``
gives it (its rows, labels and frontiers), and importance_tome once per ``--head`` (every setting of
its sweep, and its defaults row, ``r`` alone; each head scoring the block it was trained on). FLOP
ratios of the task's own forward, no timing. Prints mean / p95 / worst crop at each ``--targets``
ratio, matched on each row's frontier (``comparison.pareto.matched_error``); writes every point to
``--out`` (JSON, atomic), stamped with the machine, versions and command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without installing

STATISTICS = ("mean", "p95", "worst")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("cls", "depth"), default="cls")
    parser.add_argument("--methods", default="tome", help="comma list of methods without a head of ours (their pareto grids)")
    parser.add_argument("--trained", action="append", default=[], metavar="METHOD=DIR", help="as pullback evaluate --pareto")
    parser.add_argument("--head", action="append", default=[], metavar="DIR", help="an importance head: importance_tome's rows with it")
    parser.add_argument("--sweep", action="append", default=[], metavar="METHOD:FIELD=V1,V2",
                        help="as pullback evaluate --pareto: replaces FIELD in METHOD's grid (importance_tome's also in its rows per --head)")
    parser.add_argument("--ratios", default=None, help="the single-stage methods' ratios (default: the task's page values)")
    parser.add_argument("--targets", default="1.1,1.25,1.5,2,2.5,3", help="FLOP ratios to match at")
    parser.add_argument("--first", type=int, default=110, help="first crop (the pages measure 0-109)")
    parser.add_argument("--count", type=int, default=110, help="crops")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True, help="JSON of every point")
    return parser.parse_args(argv)


def rows_of(args: argparse.Namespace, backbone, model) -> tuple[list, list]:
    """``(points, row labels)``: the methods' pareto grids, then importance_tome's per head."""
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
    for folder in args.head:
        head = load_metric(folder, backbone.features_dim)[0]
        own = {m: g for m, g in given.items() if m == "importance_tome"}
        ours = [p for p in build_points(("importance_tome",), own, base, {"importance": head}, None, ratios)
                if p.options.head is not None]
        points += ours
        labels += [f"{Path(folder).name}: {p.row or row_rules.row_label(pareto.resolve(p.options, backbone))}" for p in ours]
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

    from pullback_ext.comparison import pareto
    from pullback_ext.comparison.backbones import demo_backbone
    from pullback_ext.comparison.evaluation import PRIMARY
    from pullback_ext.fileio import atomic_write_json
    from pullback_ext.results_pages import stamp
    from pullback_ext.sources.models import ModelSpec, load_model
    from pullback_ext.sources.photos import PhotoSource

    args = parse(argv)
    torch.set_num_threads(args.threads)
    model = load_model(ModelSpec("demo"))[0].eval()
    backbone = demo_backbone(model)
    images = PhotoSource().heldout(backbone.preprocess, args.count, after=args.first).load()["images"]
    points, labels = rows_of(args, backbone, model)
    errors = [e[PRIMARY[args.task]] for e in pareto.image_errors(backbone, images, points, args.task, 16, True)]
    cost = pareto.measure_cost(backbone, images, points, args.task, (), 1, False)
    rows: dict = {}
    for label, point, e, c in zip(labels, points, errors, cost["points"]):
        rows.setdefault(label, []).append({"knob": {k: v for k, v in point.knob.items() if k != "head"},
                                           "flop_ratio": c["flop_ratio"], "error": pareto.error_summary(e)})
    targets = tuple(float(t) for t in args.targets.split(","))
    print(table(rows, targets))
    atomic_write_json(Path(args.out), {"task": args.task, "crops": [args.first, args.first + args.count - 1],
                                       "metric": PRIMARY[args.task], "rows": rows, **stamp(" ".join(sys.argv))})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
