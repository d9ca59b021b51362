"""Strategy × ratio evaluation: Table-2-style quality, significance and cost.

Quality is always relative to the unpruned model on the same images: cosine ×100 of the CLS
embedding, additional SILog ×100 of the depth map, per-pixel KL ×100 and the argmax mIoU gap of the
segmentation logits (:data:`~pullback_ext.comparison.tasks.TASKS` says which a task reads), k-NN
top-1 (leave-one-out against the unpruned embeddings of the other images) when labels exist, and
for the segmentation task on images with per-pixel classes (rendered scenes) the mIoU of the
argmax map against those classes, of each cell and of the unpruned model. Each seed is one image set; a cell reports the
mean over seeds of the per-seed means, their standard deviation across seeds, and the standard
deviation over all images.

A *row* is one strategy with its selection and averaging rules fixed, and every table names them
(``result["rules"]``, from :func:`~pullback_ext.prune.row_rules.describe`). Where our scored
strategies (``importance``, ``oracle``) run with automatic choices, each gets a second row with the
other preset's rules (``"importance (paper preset)"`` beside ``"importance"``), so both of our
rules appear side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Sequence

import torch

from pullback_ext.comparison import quality
from pullback_ext.comparison.tasks import TASKS
from pullback_ext.comparison.backbones import Backbone
from pullback_ext.comparison.cost import FLOP_ACCOUNTING, count_flops, wall_clock
from pullback_ext.errors import PullbackError
from pullback_ext.prune.reduction_options import MODES, PRESETS, BackboneShape, Reduction, ReductionOptions
from pullback_ext.prune.row_rules import describe
from pullback_ext.prune.strategies import NEEDS_SCORER, TRAINING_FREE

METRICS = {name: task.metrics for name, task in TASKS.items()}
PRIMARY = {name: task.primary for name, task in TASKS.items()}
# metric -> (the output it compares, its per-image function)
ERRORS = {"cosine_x100": ("embedding", quality.cosine_x100), "silog_x100": ("depth", quality.silog_x100),
          "pixel_kl_x100": ("segmentation", quality.pixel_kl_x100), "miou_gap_x100": ("segmentation", quality.miou_gap_x100)}


@dataclass
class Plan:
    """What to evaluate. ``scorers``: {strategy name: scorer} for ``importance`` / ``oracle``;
    ``selection`` applies to those two (the training-free rules have no importance to weigh);
    ``recovery``: α of the pruned tokens' recovered features (prune mode; None: the frozen copy)."""

    task: str
    strategies: tuple
    ratios: tuple
    layers: tuple
    mode: str
    llf: tuple = (True,)
    scorers: dict = field(default_factory=dict)
    spn: Optional[Callable] = None
    prop_attn: bool | Literal["auto"] = "auto"
    selection: str = "auto"
    batch_size: int = 16
    knn_k: int = 10
    preset: str = "recommended"
    recovery: Optional[float] = None

    def reduction(self, backbone: Backbone, strategy: str, ratio: float, llf, seed: int, preset: Optional[str] = None) -> Reduction:
        """The reduction of one cell (``llf``: one entry of ``self.llf``; ``preset``: default ``self.preset``)."""
        options = ReductionOptions(
            head=self.scorers.get(strategy), ratio=ratio, layers=self.layers, mode=self.mode, strategy=strategy, llf=llf,
            spn=self.spn, prop_attn=self.prop_attn, seed=seed, selection=self.selection if strategy in NEEDS_SCORER else "auto",
            preset=self.preset if preset is None else preset, recovery=self.recovery,
        )
        return options.resolve(BackboneShape(depth=backbone.depth, num_prefix=backbone.num_prefix, has_cls=backbone.has_cls))

    def rows(self, backbone: Backbone) -> list["Row"]:
        """Every row of the tables: one per strategy under ``self.preset``, and for a scored
        strategy with automatic selection a second one under the other preset where its rules differ."""
        out = []
        for strategy in self.strategies:
            out.append(Row(strategy, strategy, self.preset))
            if strategy not in NEEDS_SCORER or self.selection != "auto":
                continue
            other = next(p for p in PRESETS if p != self.preset)
            ratio, llf = self.ratios[-1], self.llf[0]
            if describe(self.reduction(backbone, strategy, ratio, llf, 0, other)) != describe(self.reduction(backbone, strategy, ratio, llf, 0)):
                out.append(Row(f"{strategy} ({other} preset)", strategy, other))
        return out

    def row_reduction(self, backbone: Backbone, row: "Row", ratio: float, llf, seed: int) -> Reduction:
        return self.reduction(backbone, row.strategy, ratio, llf, seed, row.preset)


@dataclass(frozen=True)
class Row:
    """One table row: its ``key`` in the results, the ``strategy`` and the ``preset`` it runs under."""

    key: str
    strategy: str
    preset: str


def check_task(task: str, backbone: Backbone) -> None:
    """Refuse a ``--task`` the backbone has no decoder for."""
    if task not in backbone.tasks:
        raise PullbackError(f"--task {task} needs a model with that decoder; {backbone.name} supports {', '.join(backbone.tasks)}")


def check_plan(plan: Plan, backbone: Backbone) -> None:
    """Fail early, with the offending option named, before any forward pass."""
    if plan.mode not in MODES:
        raise PullbackError(f"mode must be one of {', '.join(MODES)}; got {plan.mode!r}")
    check_task(plan.task, backbone)
    if not plan.strategies:
        raise PullbackError("--strategies must name at least one strategy")
    if not plan.ratios:
        raise PullbackError("--ratios must name at least one ratio")
    for strategy in plan.strategies:
        for llf in plan.llf:
            for ratio in plan.ratios:
                plan.reduction(backbone, strategy, ratio, llf, 0)


def batched_outputs(fn, images: torch.Tensor, batch_size: int, before=None) -> dict:
    """``fn`` (images -> dict of outputs) over ``images`` in chunks of ``batch_size``, outputs
    concatenated; ``before(chunk)`` runs first on each chunk."""
    outs: dict = {}
    for start in range(0, images.shape[0], batch_size):
        chunk = images[start:start + batch_size]
        if before is not None:
            before(chunk)
        for key, value in fn(chunk).items():
            outs.setdefault(key, []).append(value.detach())
    return {key: torch.cat(values) for key, values in outs.items()}


def _prepare_scorers(plan: Plan, strategy: str):
    """A function recording per-image state in the strategy's scorer(s) before each batch, or None."""
    scorer = plan.scorers.get(strategy)
    found = [getattr(s, "prepare", None) for s in (scorer if isinstance(scorer, (list, tuple)) else (scorer,))]
    found = [p for p in found if callable(p)]
    if not found:
        return None

    def prepare(images):
        for p in found:
            p(images)

    return prepare


def output_errors(task: str, reduced: dict, full: dict) -> dict:
    """Per-image errors ``{metric: [n]}`` of the ``reduced`` outputs against the ``full`` ones, for
    every metric of ``task`` (:data:`METRICS`)."""
    return {metric: ERRORS[metric][1](reduced[ERRORS[metric][0]], full[ERRORS[metric][0]]) for metric in METRICS[task]}


def label_miou(task: str, outputs: dict, data: dict) -> Optional[float]:
    """mIoU of the argmax class map of ``outputs`` against the per-pixel classes of ``data``
    (``classes [n, H, W]``, rendered scenes), over the confusion matrix summed over the ``n``
    images (classes present in either map); None unless ``task`` is a segmentation task and
    ``data`` has classes."""
    classes = data.get("classes")
    if task != "segmentation" or classes is None:
        return None
    logits = outputs["segmentation"]
    confusion = quality.confusion_matrices(logits.argmax(dim=1), classes.to(logits.device), logits.shape[1]).sum(dim=0)
    return float(quality.mean_iou(confusion))


def _summary(per_seed: list) -> dict:
    means = [float(v.double().mean()) for v in per_seed]
    everything = torch.cat([v.double().flatten() for v in per_seed])
    return {
        "mean": sum(means) / len(means),
        "std": float(torch.tensor(means).std(unbiased=True)) if len(means) > 1 else 0.0,
        "image_std": float(everything.std(unbiased=False)),
        "per_seed": means,
    }


def run_quality(backbone: Backbone, image_sets: list, plan: Plan, progress: bool = True) -> dict:
    """Quality tables. ``image_sets``: one dict per seed with ``images [n, 3, H, W]`` and
    optionally ``labels [n]``. Returns JSON-ready results (see module doc)."""
    from pullback_ext.progress import progress_bar

    check_plan(plan, backbone)
    rows = plan.rows(backbone)
    cells = [(llf, row, r) for llf in plan.llf for row in rows for r in plan.ratios]
    per_image: dict = {}
    knn: dict = {}
    segment: dict = {}  # label mIoU per seed (segmentation on images with classes)
    bar = progress_bar(total=len(image_sets) * len(cells), desc="evaluate", enabled=progress, unit="cell")
    with torch.no_grad():
        for seed, data in enumerate(image_sets):
            images, labels = data["images"], data.get("labels")
            full = batched_outputs(backbone.full, images, plan.batch_size)
            if labels is not None:
                knn.setdefault("unpruned", []).append(
                    quality.knn_top1(full["embedding"], labels, full["embedding"], labels, plan.knn_k, exclude_self=True))
            unpruned_miou = label_miou(plan.task, full, data)
            if unpruned_miou is not None:
                segment.setdefault("unpruned", []).append(unpruned_miou)
            for llf, row, ratio in cells:
                reduction = plan.row_reduction(backbone, row, ratio, llf, seed)
                reduced = batched_outputs(lambda x: backbone.reduced(reduction, x), images, plan.batch_size, _prepare_scorers(plan, row.strategy))
                for metric, values in output_errors(plan.task, reduced, full).items():
                    per_image.setdefault((llf, row.key, ratio, metric), []).append(values)
                if labels is not None:
                    knn.setdefault((llf, row.key, ratio), []).append(
                        quality.knn_top1(full["embedding"], labels, reduced["embedding"], labels, plan.knn_k, exclude_self=True))
                if unpruned_miou is not None:
                    segment.setdefault((llf, row.key, ratio), []).append(label_miou(plan.task, reduced, data))
                bar.update(1)
    bar.close()
    result = _assemble(plan, image_sets, per_image, {"knn_top1": knn, "label_miou": segment})
    result["rules"] = {table_key(plan.mode, llf): {row.key: describe(plan.row_reduction(backbone, row, plan.ratios[-1], llf, 0)) for row in rows}
                       for llf in plan.llf}
    return result


def table_key(mode: str, llf) -> str:
    """Name of a table in the results: ``merge``, or for prune mode ``llf`` (the default masked
    fusion, ``llf=True``), ``llf_full`` or ``no_llf``."""
    if mode == "merge":
        return "merge"
    return {True: "llf", "masked": "llf", "full": "llf_full", False: "no_llf"}[llf]


def _assemble(plan: Plan, image_sets: list, per_image: dict, per_seed: dict) -> dict:
    """The results; ``per_seed``: ``{measure: {(llf, row, ratio) or "unpruned": [one value per seed]}}``
    of the per-seed scores (k-NN top-1, label mIoU), each cell's mean and per-seed values beside the metrics."""
    tables: dict = {}
    for (llf, strategy, ratio, metric), values in per_image.items():
        cell = tables.setdefault(table_key(plan.mode, llf), {}).setdefault(strategy, {}).setdefault(f"{ratio:g}", {})
        cell[metric] = _summary(values)
    for measure, scores in per_seed.items():
        for key, values in scores.items():
            if key == "unpruned":
                continue
            llf, strategy, ratio = key
            tables[table_key(plan.mode, llf)][strategy][f"{ratio:g}"][measure] = {"mean": sum(values) / len(values), "per_seed": values}
    result = {
        "task": plan.task, "mode": plan.mode, "layers": list(plan.layers), "ratios": list(plan.ratios),
        "strategies": list(plan.strategies), "seeds": len(image_sets),
        "images_per_seed": [int(d["images"].shape[0]) for d in image_sets], "tables": tables,
        "wilcoxon": _wilcoxon(plan, per_image),
    }
    for measure, scores in per_seed.items():
        if "unpruned" in scores:
            result[f"{measure}_unpruned"] = sum(scores["unpruned"]) / len(scores["unpruned"])
    return result


def _wilcoxon(plan: Plan, per_image: dict) -> dict:
    """Per ratio: one-sided signed-rank p-value of importance against the best training-free
    baseline (lowest mean primary error at that ratio), paired over every image of every seed."""
    metric = PRIMARY[plan.task]
    baselines = [s for s in plan.strategies if s in TRAINING_FREE]
    out: dict = {}
    if "importance" not in plan.strategies or not baselines:
        return out
    for llf in plan.llf:
        for ratio in plan.ratios:
            ours = torch.cat(per_image[(llf, "importance", ratio, metric)])
            best = min(baselines, key=lambda s: float(torch.cat(per_image[(llf, s, ratio, metric)]).mean()))
            theirs = torch.cat(per_image[(llf, best, ratio, metric)])
            out.setdefault(table_key(plan.mode, llf), {})[f"{ratio:g}"] = {
                "metric": metric, "baseline": best, "p_value": quality.wilcoxon_p(ours, theirs),
                "importance_mean": float(ours.mean()), "baseline_mean": float(theirs.mean()),
            }
    return out


def run_cost(backbone: Backbone, images: torch.Tensor, plan: Plan, batches=(1, 64), repeats: int = 3,
             strategies: Optional[tuple] = None, progress: bool = True) -> dict:
    """FLOPs per image (:data:`~pullback_ext.comparison.cost.FLOP_ACCOUNTING`: the plan's task's
    forward at batch 1) and wall-clock at each batch size for the unpruned model and every row ×
    ratio (first LLF setting of the plan) of the given ``strategies`` (default all), keyed by row."""
    from pullback_ext.progress import progress_bar

    full, reduced = backbone.forwards(plan.task)
    strategies = plan.strategies if strategies is None else strategies
    inputs = {b: images[torch.arange(b) % images.shape[0]] for b in batches}
    llf = plan.llf[0]

    def measure(fn, prepare=None) -> dict:
        entry: dict = {}
        if prepare is not None:
            prepare(inputs[batches[0]][:1])
        entry["gflops_per_image"] = count_flops(fn, inputs[batches[0]][:1]) / 1e9
        for b in batches:
            if prepare is not None:
                prepare(inputs[b])
            entry[f"batch{b}"] = wall_clock(fn, inputs[b], repeats=repeats)
        return entry

    cells = [(row, r) for row in plan.rows(backbone) if row.strategy in strategies for r in plan.ratios]
    bar = progress_bar(total=len(cells) + 1, desc="cost", enabled=progress, unit="run")
    out = {"batches": list(batches), "repeats": repeats, "llf": llf, "flops": FLOP_ACCOUNTING, "unpruned": measure(full)}
    bar.update(1)
    base = out["unpruned"]
    for row, ratio in cells:
        reduction = plan.row_reduction(backbone, row, ratio, llf, 0)
        entry = measure(lambda x: reduced(reduction, x), _prepare_scorers(plan, row.strategy))
        entry["flop_ratio"] = base["gflops_per_image"] / entry["gflops_per_image"]
        for b in batches:
            entry[f"speedup_batch{b}"] = base[f"batch{b}"]["median_s"] / entry[f"batch{b}"]["median_s"]
        out.setdefault(row.key, {})[f"{ratio:g}"] = entry
        bar.update(1)
    bar.close()
    return out


def run_flop_ratios(backbone: Backbone, image: torch.Tensor, plan: Plan) -> dict:
    """``{table key: {row: {ratio: FLOP ratio}}}`` of every cell of ``plan``: unpruned FLOPs over
    the cell's (torch's flop counter on ``image [1, 3, H, W]`` over the task's own forward,
    :meth:`~pullback_ext.comparison.backbones.Backbone.forwards`, scoring included), the cost axis
    the quality plots are drawn against."""
    full, reduced = backbone.forwards(plan.task)
    base = count_flops(full, image)
    out: dict = {}
    for llf in plan.llf:
        for row in plan.rows(backbone):
            prepare = _prepare_scorers(plan, row.strategy)
            if prepare is not None:
                prepare(image)  # per-image state of the scorer, the same for every ratio
            for ratio in plan.ratios:
                reduction = plan.row_reduction(backbone, row, ratio, llf, 0)
                flops = count_flops(lambda x: reduced(reduction, x), image)
                out.setdefault(table_key(plan.mode, llf), {}).setdefault(row.key, {})[f"{ratio:g}"] = base / flops
    return out


def markdown_table(result: dict, llf_key: str, metrics: Optional[Sequence[str]] = None) -> str:
    """One quality table (``llf_key`` from :func:`table_key`) as markdown: one row per strategy and
    rule set (named with its selection and averaging), columns ratios, cells mean ± std across
    seeds, for each of ``metrics`` (default the task's); then the label mIoU where it was measured
    and the Wilcoxon rows."""
    metrics = METRICS[result["task"]] if metrics is None else metrics
    table = result["tables"][llf_key]
    rules = result.get("rules", {}).get(llf_key, {})
    ratios = [f"{r:g}" for r in result["ratios"]]
    lines = []
    for metric in metrics:
        lines.append(f"**{metric}** ({llf_key}, layers {result['layers']}, {result['seeds']} seeds)\n")
        lines.append("| row | selection | averaging | " + " | ".join(f"η={r}" for r in ratios) + " |")
        lines.append("|---|---|---|" + "---|" * len(ratios))
        for key, cells in table.items():
            rule = rules.get(key, {})
            row = [f"{_fmt(cells[r][metric]['mean'])} ± {_fmt(cells[r][metric]['std'])}" for r in ratios]
            lines.append(f"| {key} | {rule.get('selection', '—')} | {rule.get('averaging', '—')} | " + " | ".join(row) + " |")
        lines.append("")
    if "label_miou_unpruned" in result:
        lines.append(f"**label_miou** ({llf_key}: mIoU of the argmax map against the renderer's classes, data set of each seed; "
                     f"unpruned {_fmt(result['label_miou_unpruned'])})\n")
        lines.append("| row | " + " | ".join(f"η={r}" for r in ratios) + " |")
        lines.append("|---|" + "---|" * len(ratios))
        for key, cells in table.items():
            lines.append(f"| {key} | " + " | ".join(_fmt(cells[r]["label_miou"]["mean"]) for r in ratios) + " |")
        lines.append("")
    if result.get("wilcoxon", {}).get(llf_key):
        lines.append("| η | best baseline | importance | baseline | Wilcoxon p (one-sided) |")
        lines.append("|---|---|---|---|---|")
        for r, w in result["wilcoxon"][llf_key].items():
            p = "n/a" if w["p_value"] is None else f"{w['p_value']:.2e}"
            lines.append(f"| {r} | {w['baseline']} | {_fmt(w['importance_mean'])} | {_fmt(w['baseline_mean'])} | {p} |")
        lines.append("")
    return "\n".join(lines)



def flop_table(cost: dict) -> str:
    """The FLOP ratio (unpruned / reduced FLOPs per image) of every timed row × ratio of
    :func:`run_cost`'s ``cost``, after the note saying how FLOPs are counted."""
    rows = {key: cells for key, cells in cost.items() if isinstance(cells, dict) and key != "unpruned" and
            all(isinstance(c, dict) and "flop_ratio" in c for c in cells.values())}
    ratios = list(dict.fromkeys(r for cells in rows.values() for r in cells))
    lines = [f"**FLOP ratio** (unpruned {cost['unpruned']['gflops_per_image']:.3f} GFLOPs per image). {cost['flops']}\n",
             "| row | " + " | ".join(f"η={r}" for r in ratios) + " |", "|---|" + "---|" * len(ratios)]
    for key, cells in rows.items():
        lines.append(f"| {key} | " + " | ".join(f"{cells[r]['flop_ratio']:.2f}×" if r in cells else "–" for r in ratios) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: float) -> str:
    """Three decimals, or three significant digits for values below 0.01."""
    return f"{value:.2e}" if 0 < abs(value) < 0.01 else f"{value:.3f}"
