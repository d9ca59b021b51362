"""Training DTEM's decoupled embeddings with the backbone frozen (the authors' "modular training":
only the embeddings learn, ``train.py:299-302``), on the demo model, a timm VisionTransformer or a
Hugging Face model of :mod:`pullback_ext.families`, through the evaluation's
:class:`~pullback_ext.comparison.backbones.Backbone` (its task forward, with a DTEM reduction whose
method runs the relaxed forward, :class:`~pullback_ext.dtem_training.relaxed.RelaxedDTEM`).

Objective: the task's own distortion of the relaxed model against the unreduced model, the
quantity ``pullback evaluate`` reports (:mod:`pullback_ext.comparison.quality`): CLS
``cosine_x100`` of the embedding, depth ``silog_x100`` of the depth map. The authors instead train
on ImageNet-1k with the reduced classifier's cross-entropy against the labels (soft targets under
mixup/cutmix, ``train.py:155, 189``); here there are no labels and the target is the frozen model
itself. ``r`` merges in every block, as the authors train (``--reduction 16``, ``train.py:53``).
The loop, checkpoints (kind ``dtem``), resume, DDP and progress bar are
:func:`pullback_ext.metric.training.fit`'s, with the authors' gradient clip 5 (``train.py:83``) and
their cosine floor, min-lr / lr = 1e-6 / 1e-4 (``train.py:80-81``). The targets are computed once,
before training.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from pullback_ext.comparison import quality
from pullback_ext.comparison.backbones import Backbone
from pullback_ext.errors import PullbackError
from pullback_ext.metric.training import TrainConfig
from pullback_ext.prune.methods.dtem import CHECKPOINT_KINDS, DecoupledEmbedding, embedding_for
from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions
from pullback_ext.dtem_training.relaxed import Relaxation, RelaxedDTEM, merge_counts

TASKS = ("cls", "depth")
GRAD_CLIP = 5.0  # the authors' --clip-grad (train.py:83)
MIN_LR_RATIO = 0.01  # the authors' --min-lr / --lr = 1e-6 / 1e-4 (train.py:80-81)


@dataclass(frozen=True)
class DTEMConfig:
    """One training run: ``task`` cls | depth, ``r`` tokens merged softly in every block (the
    authors' 16), the soft grouping ``relax`` (k2, τ1, τ2), ``feat_dim`` of the embeddings (None:
    the authors' rule), ``train`` (batch, steps, lr, seed, checkpoints)."""

    task: str
    train: TrainConfig
    r: int = 16
    relax: Relaxation = Relaxation()
    feat_dim: Optional[int] = None

    def __post_init__(self):
        if self.task not in TASKS:
            raise PullbackError(f"--task: a DTEM embedding is trained for cls or depth; got {self.task!r}")
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise PullbackError(f"--r: expected an int >= 1 (tokens merged per block in training), got {self.r!r}")
        if self.feat_dim is not None and (not isinstance(self.feat_dim, int) or self.feat_dim < 1):
            raise PullbackError(f"--feat-dim: expected an int >= 1, got {self.feat_dim!r}")


def train_config(config: TrainConfig) -> TrainConfig:
    """``config`` with the authors' gradient clip and cosine floor."""
    return dataclasses.replace(config, grad_clip=GRAD_CLIP, min_lr_ratio=MIN_LR_RATIO)


def distortion_x100(task: str, reduced: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Per-image distortion ``[B]`` as ``pullback evaluate`` measures it: CLS ``100·(1 − cos)`` of
    embeddings ``[B, E]``, depth the SILog ×100 of depth maps ``[B, H, W]``."""
    return quality.cosine_x100(reduced, full) if task == "cls" else quality.silog_x100(reduced, full)


def output_key(task: str) -> str:
    return "embedding" if task == "cls" else "depth"


def shape_of(backbone: Backbone) -> BackboneShape:
    return BackboneShape(depth=backbone.depth, num_prefix=backbone.num_prefix, has_cls=backbone.has_cls)


class RelaxedRunner:
    """The relaxed model's output of ``task`` (``reduced``: the backbone's reduced forward of that task)."""

    def __init__(self, backbone: Backbone, task: str, r: int, relax: Relaxation):
        self.reduced, self.key, self.shape = backbone.forwards(task)[1], output_key(task), shape_of(backbone)
        self.r, self.method = r, RelaxedDTEM(relax)

    def __call__(self, embedding: DecoupledEmbedding, images: torch.Tensor) -> torch.Tensor:
        reduction = ReductionOptions(strategy="dtem", head=embedding, r=self.r).resolve(self.shape)
        return self.reduced(dataclasses.replace(reduction, method=self.method), images)[self.key]


@dataclass
class DTEMTask:
    """The :class:`~pullback_ext.metric.training.Task` of DTEM: the relaxed model's distortion."""

    runner: RelaxedRunner
    task: str
    kind: str = field(default="dtem", init=False)

    def loss(self, model, batch: dict, indices, step: int):
        d = distortion_x100(self.task, model(self.runner, batch["images"]), batch["target"])
        return d.mean(), {}


def embedded_model(model, backbone: Backbone):
    """The module whose blocks DTEM patches: the demo's timm backbone, or ``model`` itself; a
    rotary family is refused (the relaxed forward reorders tokens and tracks no rotary positions)."""
    from pullback_ext.families import detect

    target = model.backbone if backbone.name == "demo" else model
    family = detect(target, who="--model")
    if family.rotary:
        raise PullbackError(f"--model: DTEM training does not run on {family.title} (rotary positions); "
                            f"train on a model without a rotary embedding")
    return target


def check_budget(r: int, backbone: Backbone, num_patch: int) -> None:
    """Every block must merge in training (each embedding learns only through its own block's merge)."""
    counts = merge_counts(r, backbone.num_prefix, num_patch, backbone.depth)
    if min(counts) < 1:
        raise PullbackError(f"--r: with r = {r} block {counts.index(0)} of {backbone.depth} has no tokens left to merge "
                            f"({num_patch} patch tokens); lower --r")


@torch.no_grad()
def targets(backbone: Backbone, task: str, images: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """The unreduced model's outputs of ``task`` on ``images``."""
    full = backbone.forwards(task)[0]
    return torch.cat([full(images[s:s + batch])[output_key(task)] for s in range(0, len(images), batch)])


def train(model, images: torch.Tensor, config: DTEMConfig, out: Path, resume: bool = False, progress: bool = True,
          on_step=None, backbone: Optional[Backbone] = None, extra: Optional[dict] = None) -> DecoupledEmbedding:
    """Train a :class:`DecoupledEmbedding` for the frozen ``model`` on ``images [n, 3, H, W]``;
    checkpoints in ``out`` (``on_step(step)``: as in :func:`~pullback_ext.metric.training.fit`).
    ``backbone``: the model's view (None: ``model`` is the demo model); ``extra``: stored in the
    checkpoint's config under ``dtem`` (the model and images it was trained on)."""
    from pullback_ext.comparison.backbones import demo_backbone
    from pullback_ext.metric.training import fit

    backbone = demo_backbone(model) if backbone is None else backbone
    if config.task not in backbone.tasks:
        raise PullbackError(f"--task: {backbone.name} serves {', '.join(backbone.tasks)}; got {config.task!r}")
    model.eval().requires_grad_(False)
    target = embedded_model(model, backbone)
    check_budget(config.r, backbone, backbone.block_tokens(images[:1], 0).shape[1])
    torch.manual_seed(config.train.seed)
    embedding = embedding_for(target, config.feat_dim)
    data = {"images": images, "target": targets(backbone, config.task, images)}
    task = DTEMTask(RelaxedRunner(backbone, config.task, config.r, config.relax), config.task)
    settings = {"task": config.task, "r": config.r, **asdict(config.relax), "feat_dim": embedding.feat_dim, **(extra or {})}
    fit(task, embedding, data, train_config(config.train), out, extra_config={"dtem": settings}, resume=resume,
        progress=progress, on_step=on_step, classes=CHECKPOINT_KINDS)
    return embedding


@torch.no_grad()
def heldout_report(backbone: Backbone, methods: dict, task: str, images: torch.Tensor, rs: Sequence[int],
                   batch: int = 16) -> list[dict]:
    """Mean distortion ×100 against the unreduced model on ``images`` (CLS ``100·(1 − cos)``, depth
    SILog ×100) of each deployed row of ``methods`` (``{row: reduction options but r}``, e.g.
    ``{"dtem": {"strategy": "dtem", "head": embedding}, "tome": {"strategy": "tome"}}``) at each ``r``."""
    from pullback_ext.comparison.pareto import resolve

    full = targets(backbone, task, images, batch)
    reduced = backbone.forwards(task)[1]
    rows = []
    for r in rs:
        for row, options in methods.items():
            reduction = resolve(ReductionOptions(**options, r=int(r)), backbone)
            out = torch.cat([reduced(reduction, images[s:s + batch])[output_key(task)] for s in range(0, len(images), batch)])
            rows.append({"strategy": row, "r": int(r), "metric": "cosine x100" if task == "cls" else "SILog x100",
                         "value": float(distortion_x100(task, out, full).mean()), "images": int(len(images))})
    return rows
