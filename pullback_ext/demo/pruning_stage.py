"""The token merging / pruning part of ``pullback demo``: per decoder (a task of the task table the
demo model has: CLS embedding, DPT depth, DPT segmentation when its shipped head fits the
weights), the headline (ours against the original ToMe at matched FLOP ratio, measured speed-up
with its spread and the measured winner, :mod:`pullback_ext.demo.headline`) and a picture of what
each of its rows merged on a held-out scene, then the strategy comparison over the prune ratio η
(CLS merge; dense prune with LLF on/off; the task's errors) on held-out scenes, drawn against FLOP
ratio, and a Geosubprobe-style analysis of a linear depth probe. Quick mode uses fewer scenes and
ratios.
"""

from __future__ import annotations

from pathlib import Path

from pullback_ext.comparison.backbones import demo_backbone
from pullback_ext.comparison.evaluation import METRICS, Plan, check_plan, markdown_table, run_flop_ratios, run_quality
from pullback_ext.comparison.pareto_report import METRIC_TITLES
from pullback_ext.comparison.report import plot_quality, write_json, write_text
from pullback_ext.comparison.tasks import TASKS
from pullback_ext.demo import importance_stage
from pullback_ext.demo.headline import R, TASK_LABELS, Setup, headline_points, headline_table, merges_figure, run_headline
from pullback_ext.demo.stages import DemoInputs, StageResult
from pullback_ext.prune.schedules import scale_layers
from pullback_ext.prune.strategies import TRAINING_FREE
from pullback_ext.studies.subspace import subspace_analysis

NAME = "pruning"
QUICK = {"images": 8, "seeds": 1, "merge_ratios": (0.1, 0.3, 0.5), "prune_ratios": (0.25, 0.5), "subspace": 32}
FULL = {"images": 16, "seeds": 2, "merge_ratios": (0.05, 0.1, 0.2, 0.3, 0.5), "prune_ratios": (0.1, 0.25, 0.5), "subspace": 64}
PLAN = {quick: f"per decoder ({', '.join(TASK_LABELS.values())}): ours against ToMe at matched FLOP ratio "
               f"(r = {', '.join(map(str, R[quick]))}, timed) and a picture of the merges, "
               f"then the η sweep of {s['seeds']} × {s['images']} scenes; the subspace probe"
        for quick, s in ((True, QUICK), (False, FULL))}
# 30 / 115 s before the segmentation decoder (measured idle), which takes 35% (quick, at load 6) / 42% (at load 2.3) of the stage
EXPECTED_S = {True: 45, False: 200}
HEADLINE_TITLES = {task: f"{label}: ours against the original ToMe at matched FLOP ratio" for task, label in TASK_LABELS.items()}
FIGURE = "merges.png"  # per decoder, in pruning/TASK/: the headline's largest group on held-out scene FIGURE_SCENE
FIGURE_SCENE = 0


def sweep_spec(task: str, settings: dict, depth: int) -> dict:
    """The η sweep of ``task``: the CLS decoder soft-merges at the input of block depth/3 (ViT-B's 4);
    a dense one prunes at depth/3 and 2·depth/3 (ViT-B's 4 and 8), with Last-Layer Fusion and without."""
    if TASKS[task].dense:
        return dict(mode="prune", layers=scale_layers((4, 8), depth), ratios=settings["prune_ratios"], llf=(True, False))
    return dict(mode="merge", layers=scale_layers((4,), depth), ratios=settings["merge_ratios"], llf=(True,))


def sweep_title(task: str) -> str:
    """What the η sweep of ``task`` prints, e.g. ``dense prune, added SILog ×100 of the depth map (lower is better)``."""
    kind = "dense prune" if TASKS[task].dense else "CLS soft merge"
    return f"{kind}, {METRIC_TITLES[TASKS[task].primary]} against the unpruned model (lower is better)"


def _plan(backbone, task: str, spec: dict, head, results: dict) -> Plan:
    """The task's plan; with a head, its first stage sits at the layer the head was trained on."""
    from pullback_ext.errors import PullbackError

    layers, scorers = spec["layers"], {}
    if head is not None:
        scorer, layer = head
        moved = (layer,) + tuple(x for x in layers if x > layer)[: len(layers) - 1]
        candidate = Plan(task=task, strategies=("importance",), ratios=spec["ratios"], layers=moved, mode=spec["mode"],
                         llf=spec["llf"], scorers={"importance": scorer})
        try:
            check_plan(candidate, backbone)
            layers, scorers = moved, {"importance": scorer}
        except PullbackError as exc:
            results.setdefault("notes", []).append(f"{task}: importance head not used ({exc})")
    return Plan(task=task, strategies=tuple(scorers) + TRAINING_FREE, ratios=spec["ratios"], layers=layers, mode=spec["mode"],
                llf=spec["llf"], scorers=scorers, batch_size=16)


def _table_body(result: dict, key: str, metric: str) -> str:
    """The rows of one metric's table as printed (without its title, which names ``key``)."""
    return markdown_table(dict(result, wilcoxon={}), key, [metric]).split("\n", 1)[1]


def printed_tables(result: dict) -> str:
    """The quality tables of ``result`` as markdown, a metric's table that prints the same as an
    earlier one (e.g. the CLS cosine of dense pruning, which LLF does not touch) given once: the
    later one becomes a line saying so."""
    seen: dict = {}
    parts = []
    for key in result["tables"]:
        fresh, notes = [], []
        for metric in METRICS[result["task"]]:
            body = _table_body(result, key, metric)
            same = next((earlier for earlier, b in seen.get(metric, []) if b == body), None)
            if same is None:
                fresh.append(metric)
                seen.setdefault(metric, []).append((key, body))
            else:
                notes.append(f"**{metric}** ({key}): the same as ({same}), not repeated\n")
        parts += ([markdown_table(result, key, fresh)] if fresh else []) + notes
    return "\n".join(parts)


def _write_task(result: dict, folder: Path) -> None:
    """results.json, table.md (the headline first) and quality.png of one task; prints both tables."""
    task = result["task"]
    folder.mkdir(parents=True, exist_ok=True)
    write_json(result, folder / "results.json")
    top = headline_table(result["headline"], HEADLINE_TITLES[task])
    write_text(top + "\n" + "\n".join(markdown_table(result, key) for key in result["tables"]), folder / "table.md")
    print(f"[pruning] {top}\n[pruning] {task}: {sweep_title(task)}\n{printed_tables(result)}", flush=True)
    plot_quality(result, folder / "quality.png")


def run_demo_stage(inputs: DemoInputs, progress: bool = True) -> StageResult:
    """Run the headline, its picture and the comparison on rendered held-out scenes and write
    ``pruning/TASK/results.json``, ``table.md``, ``quality.png`` and ``merges.png`` per decoder and
    ``pruning/subspace.json`` under ``inputs.out_dir``.

    A task with one of ``inputs.heads`` also runs our methods with it (the importance strategy,
    its first stage at the head's layer; ``importance_tome`` scoring the head's probe layer); a
    task without one compares the training-free strategies and ToMe, and on a dense decoder
    ``importance_tome`` without a head scoring the layer the heads read.
    """
    model, quick = inputs.model, inputs.quick
    settings = QUICK if quick else FULL
    out = Path(inputs.out_dir) / "pruning"
    heads = {h.task: (h.head, h.layer) for h in inputs.heads}
    own, decoded = demo_backbone(model), demo_backbone(model, inputs.segmentation_head)  # decoded: with the segmentation head
    sets = [s.load() for s in inputs.images.seed_sets(inputs.preprocess, settings["images"], settings["seeds"])]
    results: dict = {"quick": quick, "heads": {task: layer for task, (_, layer) in heads.items()}}
    scenes = inputs.scenes["images"]
    for task in decoded.tasks:
        backbone = own if task in own.tasks else decoded  # the model's own decoders without the extra head's forward
        spec = sweep_spec(task, settings, backbone.depth)
        plan = _plan(backbone, task, spec, heads.get(task), results)
        head, layer = heads.get(task, (None, importance_stage.LAYER + 1))  # a head's layer: the block it reads + 1
        setup = Setup(task, head, layer - 1, spec["layers"], int(model.backbone.patch_embed.num_patches), quick)
        result = run_quality(backbone, sets, plan, progress=progress)
        result["flop_ratio"] = run_flop_ratios(backbone, sets[0]["images"][:1], plan)
        points = headline_points(backbone, setup, scenes[:1])
        result["headline"] = run_headline(backbone, scenes, setup, points, progress)
        figure = out / task / FIGURE
        figure.parent.mkdir(parents=True, exist_ok=True)
        drawn = merges_figure(model, task, points, result["headline"], scenes[FIGURE_SCENE:FIGURE_SCENE + 1], figure,
                              inputs.segmentation_head)
        result["headline"]["figure"] = {"file": str(figure.relative_to(inputs.out_dir)), "scene": FIGURE_SCENE} | drawn
        _write_task(result, out / task)
        results[task] = result
    test = inputs.images.heldout(inputs.preprocess, settings["images"]).load()
    results["subspace"] = subspace_analysis(model, model.hook_layers[1], settings["subspace"], test, quick)
    write_json(results["subspace"], out / "subspace.json")
    return StageResult(results)
