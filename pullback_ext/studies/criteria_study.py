"""``study criteria``: each training-free criterion applied at one layer at a time (a single
prune or merge stage on block ``ℓ``'s output, i.e. ``pullback evaluate --stages ℓ+1
--absolute-layers``), per task, at a fixed ratio; and for the depth task the recovery endpoints:
the pruned tokens re-inserted as ``x_t = α·x_t^frozen + (1 − α)·m_t`` (``prune.recovery.recover``).

Each cell is computed by the evaluation's own functions (``Plan.reduction``, ``output_errors``)
in the batches ``run_quality`` uses, so a layer's cell equals ``pullback evaluate``'s at that
stage. Recovery (any model the pipeline runs): the reduction's ``recovery`` option
(``pullback evaluate --recovery α``) replaces the pruned tokens' frozen features, right after the
prune stage, by ``recover`` of the full features at that layer (kept tokens unchanged); every
later re-insertion (the decoder's hooks, Last-Layer Fusion before the final block) then puts the
recovered features back. α = 1 is the plain frozen copy, i.e. the prune path itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from pullback_ext.comparison.evaluation import PRIMARY, Plan, output_errors

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
MODES = {"cls": "merge", "depth": "prune"}


def eligible_last(depth: int, tasks: Sequence[str]) -> int:
    """The last study layer at which every task can reduce: a stage at ℓ + 1 must be at most
    depth − 2 in prune mode with LLF (the final block runs on the full sequence), depth − 1 in
    merge mode."""
    return depth - 3 if "depth" in tasks else depth - 2


def _prepare(scorer, images: torch.Tensor) -> None:
    """Let a scorer record per-image state (the oracle's probe) before a batch, as evaluate does."""
    for s in scorer if isinstance(scorer, (list, tuple)) else (scorer,):
        if callable(getattr(s, "prepare", None)):
            s.prepare(images)


@dataclass
class CriteriaStudy:
    """Criteria × layers on ``image_sets`` (one dict per seed with ``images``), for ``tasks`` at
    ``ratio``. ``scorers(task, stage)`` -> ``{"importance"|"oracle": scorer}`` for the criteria
    that need one; ``alphas``: recovery endpoints of the depth task (empty: none)."""

    backbone: object
    image_sets: list
    tasks: Sequence[str]
    criteria: Sequence[str]
    ratio: float = 0.3
    alphas: Sequence[float] = ALPHAS
    batch_size: int = 16
    scorers: Callable = field(default=lambda task, stage: {})

    def work(self) -> list[tuple[int, int]]:
        """(seed, first image) of every batch: the batches ``run_quality`` forms."""
        return [(s, start) for s, data in enumerate(self.image_sets) for start in range(0, data["images"].shape[0], self.batch_size)]

    def plan(self, task: str, layer: int) -> Plan:
        return Plan(task=task, strategies=tuple(self.criteria), ratios=(self.ratio,), layers=(layer + 1,), mode=MODES[task],
                    scorers=self.scorers(task, layer + 1), batch_size=self.batch_size)

    def measure(self, layer: int, batches: list) -> list[dict]:
        """One record per batch: ``{task: {criterion: {metric: [per-image]}}}`` and, for depth,
        ``{"recovery": {criterion: {alpha: {metric: [per-image]}}}}``."""
        plans = {task: self.plan(task, layer) for task in self.tasks}
        records = []
        with torch.no_grad():
            for seed, start in batches:
                images = self.image_sets[seed]["images"][start:start + self.batch_size]
                full = self.backbone.full(images)
                records.append({task: self._cells(plans[task], seed, images, full) for task in self.tasks})
        return records

    def _cells(self, plan: Plan, seed: int, images: torch.Tensor, full: dict) -> dict:
        cells: dict = {"recovery": {}} if plan.task == "depth" and self.alphas else {}
        for criterion in plan.strategies:
            reduction = plan.reduction(self.backbone, criterion, self.ratio, True, seed)
            if criterion in plan.scorers:
                _prepare(plan.scorers[criterion], images)
            errors = output_errors(plan.task, self.backbone.reduced(reduction, images), full)
            cells[criterion] = {metric: values.tolist() for metric, values in errors.items()}
            if "recovery" in cells:
                cells["recovery"][criterion] = {f"{alpha:g}": self._recovered(plan, criterion, seed, images, full, alpha) for alpha in self.alphas}
        return cells

    def _recovered(self, plan: Plan, criterion: str, seed: int, images: torch.Tensor, full: dict, alpha: float) -> dict:
        """The depth errors of ``criterion``'s stage with its pruned tokens recovered at ``alpha``."""
        reduction = dataclasses.replace(plan, recovery=alpha).reduction(self.backbone, criterion, self.ratio, True, seed)
        return {m: v.tolist() for m, v in output_errors("depth", self.backbone.reduced(reduction, images), full).items()}

    def finish(self, layer: int, records: list) -> dict:
        """The layer's unit: per task and criterion, per metric the mean over seeds of the
        per-seed means (evaluate's figure), their std over seeds and every image's value."""
        seeds = [seed for seed, _ in self.work()]
        unit: dict = {"stage": layer + 1, "tasks": {}, "recovery": {}}
        for task in self.tasks:
            for criterion in self.criteria:
                unit["tasks"].setdefault(task, {})[criterion] = _summaries([r[task][criterion] for r in records], seeds)
                if task == "depth" and self.alphas:
                    unit["recovery"][criterion] = {a: _summaries([r[task]["recovery"][criterion][a] for r in records], seeds)
                                                   for a in records[0][task]["recovery"][criterion]}
        return unit


def _summaries(cells: list, seeds: list) -> dict:
    """``{metric: {"mean", "std", "per_seed", "images"}}`` from per-batch cells and their seeds."""
    out = {}
    for metric in cells[0]:
        per_seed: dict = {}
        for cell, seed in zip(cells, seeds):
            per_seed.setdefault(seed, []).extend(cell[metric])
        means = [float(torch.tensor(per_seed[s], dtype=torch.float64).mean()) for s in sorted(per_seed)]
        out[metric] = {"mean": sum(means) / len(means), "std": float(torch.tensor(means).std()) if len(means) > 1 else 0.0,
                       "per_seed": means, "images": [x for s in sorted(per_seed) for x in per_seed[s]]}
    return out


def summary(units: dict, tasks: Sequence[str], criteria: Sequence[str]) -> dict:
    """Across layers: per task the criterion × layer matrix of the primary error (cosine ×100 for
    cls, SILog ×100 for depth), the ranking of the criteria by their mean over layers (best
    first), Kendall τ between the tasks' mean errors, and per criterion the recovery endpoint α
    with the lowest mean SILog."""
    from scipy.stats import kendalltau

    layers = sorted(units, key=int)
    out: dict = {"layers": [int(layer) for layer in layers], "tasks": {}}
    for task in tasks:
        metric = PRIMARY[task]
        matrix = [[units[layer]["tasks"][task][c][metric]["mean"] for layer in layers] for c in criteria]
        means = {c: sum(row) / len(row) for c, row in zip(criteria, matrix)}
        out["tasks"][task] = {"metric": metric, "matrix": matrix, "mean": means,
                              "ranking": sorted(criteria, key=lambda c: means[c])}
    if len(tasks) == 2 and len(criteria) > 1:
        a, b = ([out["tasks"][t]["mean"][c] for c in criteria] for t in tasks)
        tau = kendalltau(a, b)
        out["kendall_tau"] = {"tasks": list(tasks), "tau": _finite(tau.statistic), "p_value": _finite(tau.pvalue)}
    if units[layers[0]]["recovery"]:
        out["recovery"] = _recovery(units, layers, criteria)
    return out


def _recovery(units: dict, layers: list, criteria: Sequence[str]) -> dict:
    out = {}
    for c in criteria:
        alphas = list(units[layers[0]]["recovery"][c])
        mean = {a: sum(units[layer]["recovery"][c][a]["silog_x100"]["mean"] for layer in layers) / len(layers) for a in alphas}
        per_layer = [min(alphas, key=lambda a: units[layer]["recovery"][c][a]["silog_x100"]["mean"]) for layer in layers]
        out[c] = {"silog_x100": mean, "preferred": min(alphas, key=lambda a: mean[a]), "preferred_per_layer": per_layer}
    return out


def _finite(value) -> Optional[float]:
    value = float(value)
    return value if value == value else None
