"""``study criteria``: each training-free criterion applied at one layer at a time (a single
prune or merge stage on block ``ℓ``'s output, i.e. ``pullback evaluate --stages ℓ+1
--absolute-layers``), per task of the task table (:data:`~pullback_ext.comparison.tasks.TASKS`:
merge for cls, prune for the dense tasks depth and segmentation, each task's primary error), at a
fixed ratio; and for every dense task the recovery endpoints: the pruned tokens re-inserted as
``x_t = α·x_t^frozen + (1 − α)·m_t`` (``prune.recovery.recover``).

Each cell is computed by the evaluation's own functions (``Plan.reduction``, ``output_errors``)
in the batches ``run_quality`` uses, so a layer's cell equals ``pullback evaluate``'s at that
stage. Tasks whose stages are the same reduction (the dense tasks: same mode, ratio, layer and
seed, no task-specific scorer) read their errors off one reduced forward. Recovery (any model the
pipeline runs): the reduction's ``recovery`` option (``pullback evaluate --recovery α``) replaces
the pruned tokens' frozen features, right after the prune stage, by ``recover`` of the full
features at that layer (kept tokens unchanged); every later re-insertion (the decoders' hooks,
Last-Layer Fusion before the final block) then puts the recovered features back. α = 1 is the
plain frozen copy, i.e. the prune path itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import combinations
from typing import Callable, Optional, Sequence

import torch

from pullback_ext.comparison.evaluation import PRIMARY, Plan, output_errors
from pullback_ext.comparison.tasks import get as get_task
from pullback_ext.prune.strategies import SCORERS

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
AGREE_TAU = 0.6  # two tasks' rankings "agree" at Kendall τ ≥ this (6 criteria: at most 3 of 15 pairs swapped)
EARLY_LAYERS = 2  # "the earliest layers" of seed 003's attention finding: the study's first two layers


def eligible_last(depth: int, tasks: Sequence[str]) -> int:
    """The last study layer at which every task can reduce: a stage at ℓ + 1 must be at most
    depth − 2 in prune mode with LLF (a dense task; the final block runs on the full sequence),
    depth − 1 in merge mode."""
    return depth - 3 if any(get_task(task).dense for task in tasks) else depth - 2


def recovers(task: str) -> bool:
    """Whether ``task`` has recovery endpoints: a dense task (prune mode re-inserts its pruned tokens)."""
    return get_task(task).dense


def _prepare(scorer, images: torch.Tensor) -> None:
    """Let a scorer record per-image state (the oracle's probe) before a batch, as evaluate does."""
    for s in scorer if isinstance(scorer, (list, tuple)) else (scorer,):
        if callable(getattr(s, "prepare", None)):
            s.prepare(images)


@dataclass
class CriteriaStudy:
    """Criteria × layers on ``image_sets`` (one dict per seed with ``images [n, 3, H, W]``), for
    ``tasks`` (names of the task table) at ``ratio``. ``scorers(task, stage)`` ->
    ``{"importance"|"oracle": scorer}`` for the criteria that need one; ``alphas``: recovery
    endpoints of the dense tasks (empty: none)."""

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
        return Plan(task=task, strategies=tuple(self.criteria), ratios=(self.ratio,), layers=(layer + 1,),
                    mode=get_task(task).auto_mode, scorers=self.scorers(task, layer + 1), batch_size=self.batch_size)

    def recovered_tasks(self) -> list[str]:
        """The tasks whose recovery endpoints are measured: the dense ones, when ``alphas`` are given."""
        return [task for task in self.tasks if recovers(task)] if self.alphas else []

    def measure(self, layer: int, batches: list) -> list[dict]:
        """One record per batch: ``{task: {criterion: {metric: [per-image]}}}``, a dense task's
        with ``{"recovery": {criterion: {alpha: {metric: [per-image]}}}}``."""
        plans = {task: self.plan(task, layer) for task in self.tasks}
        records = []
        with torch.no_grad():
            for seed, start in batches:
                images = self.image_sets[seed]["images"][start:start + self.batch_size]
                records.append(self._record(plans, seed, images, self.backbone.full(images)))
        return records

    def _record(self, plans: dict, seed: int, images: torch.Tensor, full: dict) -> dict:
        record: dict = {task: ({"recovery": {}} if task in self.recovered_tasks() else {}) for task in self.tasks}
        for criterion in self.criteria:
            for alpha in (None, *self.alphas):
                shared: dict = {}  # mode -> the reduced outputs every task of that mode reads (no task-specific scorer)
                for task, plan in plans.items():
                    if alpha is not None and task not in self.recovered_tasks():
                        continue
                    plan = plan if alpha is None else dataclasses.replace(plan, recovery=alpha)
                    if criterion in plan.scorers:
                        reduced = self._reduced(plan, criterion, seed, images)
                    else:
                        if plan.mode not in shared:
                            shared[plan.mode] = self._reduced(plan, criterion, seed, images)
                        reduced = shared[plan.mode]
                    errors = {metric: values.tolist() for metric, values in output_errors(task, reduced, full).items()}
                    if alpha is None:
                        record[task][criterion] = errors
                    else:
                        record[task]["recovery"].setdefault(criterion, {})[f"{alpha:g}"] = errors
        return record

    def _reduced(self, plan: Plan, criterion: str, seed: int, images: torch.Tensor) -> dict:
        """Every output of the model with ``criterion``'s stage of ``plan`` on ``images [B, 3, H, W]``."""
        reduction = plan.reduction(self.backbone, criterion, self.ratio, True, seed)
        if criterion in plan.scorers:
            _prepare(plan.scorers[criterion], images)
        return self.backbone.reduced(reduction, images)

    def finish(self, layer: int, records: list) -> dict:
        """The layer's unit: per task and criterion, per metric the mean over seeds of the
        per-seed means (evaluate's figure), their std over seeds and every image's value; per
        dense task and criterion the same at every α (``unit["recovery"][task][criterion][α]``)."""
        seeds = [seed for seed, _ in self.work()]
        unit: dict = {"stage": layer + 1, "tasks": {}, "recovery": {}}
        for task in self.tasks:
            for criterion in self.criteria:
                unit["tasks"].setdefault(task, {})[criterion] = _summaries([r[task][criterion] for r in records], seeds)
                if task in self.recovered_tasks():
                    unit["recovery"].setdefault(task, {})[criterion] = {
                        a: _summaries([r[task]["recovery"][criterion][a] for r in records], seeds)
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
    """Across layers: per task the criterion × layer matrix of its primary error (the task
    table's: cosine ×100 for cls, SILog ×100 for depth, per-pixel KL ×100 for segmentation) and
    the ranking of the criteria by their mean over layers (best first); per pair of tasks Kendall
    τ between their criteria's mean errors and at every layer (``kendall_tau``); per dense task
    and criterion the recovery endpoint α with the lowest mean primary error (``recovery``); and
    what the study says about seed 003's three findings (``seed_003``, :func:`seed_003`)."""
    layers = sorted(units, key=int)
    out: dict = {"layers": [int(layer) for layer in layers], "tasks": {}}
    for task in tasks:
        metric = PRIMARY[task]
        matrix = [[units[layer]["tasks"][task][c][metric]["mean"] for layer in layers] for c in criteria]
        means = {c: sum(row) / len(row) for c, row in zip(criteria, matrix)}
        out["tasks"][task] = {"metric": metric, "matrix": matrix, "mean": means,
                              "ranking": sorted(criteria, key=lambda c: means[c])}
    out["kendall_tau"] = [_agreement(out["tasks"], a, b, criteria) for a, b in combinations(tasks, 2)] if len(criteria) > 1 else []
    recovered = units[layers[0]]["recovery"]
    if recovered:
        out["recovery"] = {task: _recovery(units, layers, criteria, task) for task in recovered}
    out["seed_003"] = seed_003(out, criteria)
    return out


def _agreement(per_task: dict, a: str, b: str, criteria: Sequence[str]) -> dict:
    """Kendall τ (``scipy.stats.kendalltau``, τ-b) between tasks ``a`` and ``b``'s criteria: of
    their mean errors (with its p-value) and of their errors at each layer; ``agree``: τ of the
    means at least :data:`AGREE_TAU`."""
    from scipy.stats import kendalltau

    tau = kendalltau([per_task[a]["mean"][c] for c in criteria], [per_task[b]["mean"][c] for c in criteria])
    columns = list(zip(*per_task[a]["matrix"])), list(zip(*per_task[b]["matrix"]))
    per_layer = [_finite(kendalltau(x, y).statistic) for x, y in zip(*columns)]
    value = _finite(tau.statistic)
    return {"tasks": [a, b], "tau": value, "p_value": _finite(tau.pvalue), "per_layer": per_layer,
            "agree": value is not None and value >= AGREE_TAU, "best": [per_task[a]["ranking"][0], per_task[b]["ranking"][0]]}


def _recovery(units: dict, layers: list, criteria: Sequence[str], task: str) -> dict:
    """A dense task's endpoints: per criterion the primary error at each α (mean over layers),
    the α where it is lowest, and that α at each layer."""
    metric = PRIMARY[task]
    out: dict = {"metric": metric, "criteria": {}}
    for c in criteria:
        cells = [units[layer]["recovery"][task][c] for layer in layers]
        alphas = list(cells[0])
        mean = {a: sum(cell[a][metric]["mean"] for cell in cells) / len(cells) for a in alphas}
        out["criteria"][c] = {"mean": mean, "preferred": min(alphas, key=lambda a: mean[a]),
                              "preferred_per_layer": [min(alphas, key=lambda a: cell[a][metric]["mean"]) for cell in cells]}
    return out


def seed_003(s: dict, criteria: Sequence[str]) -> dict:
    """The study's reading of seed 003's (TAP's) probe findings, from a :func:`summary` ``s``:

    - ``rankings``: per pair of tasks whether their rankings differ (τ of the mean errors below
      :data:`AGREE_TAU`; the seed: segmentation and detection rank the criteria differently);
    - ``attention`` (with cls, random and a criterion that reads attention): per task and such
      criterion its error over random's at each layer, their mean over the first
      :data:`EARLY_LAYERS` layers and over the rest, and per criterion whether cls is the most
      sensitive early (its early ratio above its later one and above every dense task's early
      one; None without layers after the early ones; the seed: classification is especially
      sensitive to attention-based pruning in the earliest layers);
    - ``endpoints`` (two dense tasks or more with recovery): per criterion each task's preferred
      α and whether they include both ends of the α range (the seed: the dense tasks prefer
      opposite recovery endpoints).
    """
    out: dict = {"rankings": [{"tasks": pair["tasks"], "differ": not pair["agree"]} for pair in s["kendall_tau"]]}
    attention = [c for c in criteria if SCORERS[c].attention != "none"]
    if "cls" in s["tasks"] and "random" in criteria and attention:
        out["attention"] = _attention(s, criteria, attention)
    recovered = s.get("recovery", {})
    if len(recovered) > 1:
        alphas = [float(a) for a in next(iter(recovered.values()))["criteria"][criteria[0]]["mean"]]
        per_criterion = {c: {task: r["criteria"][c]["preferred"] for task, r in recovered.items()} for c in criteria}
        opposite = [c for c, prefs in per_criterion.items() if {min(alphas), max(alphas)} <= {float(a) for a in prefs.values()}]
        out["endpoints"] = {"tasks": list(recovered), "preferred": per_criterion, "opposite": opposite}
    return out


def _attention(s: dict, criteria: Sequence[str], attention: list) -> dict:
    def mean(values: list) -> Optional[float]:
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    ratios: dict = {}
    for task, t in s["tasks"].items():
        random = t["matrix"][list(criteria).index("random")]
        for c in attention:
            row = [v / r if r > 0 else None for v, r in zip(t["matrix"][list(criteria).index(c)], random)]
            ratios.setdefault(task, {})[c] = {"per_layer": row, "early": mean(row[:EARLY_LAYERS]), "later": mean(row[EARLY_LAYERS:])}
    dense = [task for task in s["tasks"] if get_task(task).dense]
    holds = {}
    for c in attention:
        cls = ratios["cls"][c]
        others = [ratios[task][c]["early"] for task in dense]
        testable = cls["early"] is not None and cls["later"] is not None
        holds[c] = bool(cls["early"] > cls["later"] and all(o is None or cls["early"] > o for o in others)) if testable else None
    return {"criteria": attention, "early_layers": s["layers"][:EARLY_LAYERS], "ratio_to_random": ratios, "cls_most_sensitive_early": holds}


def _finite(value) -> Optional[float]:
    value = float(value)
    return value if value == value else None
