"""Fine-tuning an importance head through importance_tome's relaxed merging (``pullback train
finetune``): the head's Jacobian-distilled weights (``pullback train head``) as the start, DTEM's
training as the method — the relaxed model's distortion of the task against the unreduced model,
the backbone frozen (:mod:`pullback_ext.dtem_training.importance` for the forward).

Every step runs importance_tome with its defaults (``schedule`` and ``early_merges`` chosen from
``r``, the default guard, partner and ``shrink``; ``score_layer`` the block the head was trained
on) at one ``r`` of ``budgets``, in turn (step ``s``
takes ``budgets[s mod len]``): the head learns for every speed-up a user will ask of it, not for
one. Objective and optimisation as :mod:`pullback_ext.dtem_training.training` (CLS ``100·(1 − cos)``
of the embedding, depth SILog ×100; gradient clip 5, cosine floor 1%). The result is an importance
head checkpoint like the one it started from (its probe, targets and training records kept, a
``finetune`` record added), which ``--head`` and ``patch.timm(..., head=...)`` take unchanged;
the loop's own checkpoints and resume state are in ``OUT/training``.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from pullback_ext.comparison import pareto
from pullback_ext.comparison.backbones import Backbone
from pullback_ext.dtem_training.importance import RELAXATION, RelaxedImportanceToMe
from pullback_ext.dtem_training.relaxed import Relaxation
from pullback_ext.dtem_training.training import TASKS, distortion_x100, output_key, targets, train_config
from pullback_ext.errors import PullbackError
from pullback_ext.metric.training import TrainConfig
from pullback_ext.prune.reduction_options import ReductionOptions

# The r of each step in turn: ToMe's sweep on the demo from 1.1x to past 3x (constant schedule).
BUDGETS = (8, 12, 16, 20, 24, 32, 40)
TRAINING_FOLDER = "training"  # OUT/training: the loop's checkpoints and resume state
# what a fine-tuned checkpoint does not carry over from the head it started from
_REPLACED = ("format", "kind", "model", "weights_sha256", "step")


@dataclass(frozen=True)
class FinetuneConfig:
    """One run: ``task`` cls | depth, ``budgets`` the ``r`` of each step in turn, the soft grouping
    ``relax``, ``train`` (batch, steps, lr, seed, checkpoints)."""

    task: str
    train: TrainConfig
    budgets: tuple = BUDGETS
    relax: Relaxation = RELAXATION

    def __post_init__(self):
        if self.task not in TASKS:
            raise PullbackError(f"--task: an importance head is fine-tuned for cls or depth; got {self.task!r}")
        budgets = tuple(self.budgets)
        if not budgets or any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in budgets):
            raise PullbackError(f"--budgets: expected ints >= 1 (ToMe's r of each step in turn), got {self.budgets!r}")
        object.__setattr__(self, "budgets", budgets)


def score_layer_of(head_config: dict) -> int:
    """The block whose output the head scores: the probe layer it was trained on (default 1)."""
    layer = head_config.get("probe", {}).get("layer", 1)
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise PullbackError(f"--init-head: the checkpoint's probe layer must be a block index, got {layer!r}")
    return layer


class Finetuned(nn.Module):
    """The module the loop trains: ``forward(runner, images, r)`` = ``runner(self.head, images, r)``
    (a call through the module, so that DDP synchronises the head's gradients)."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def config(self) -> dict:
        return {"head": self.head.config()}

    def forward(self, runner, images: torch.Tensor, r: int) -> torch.Tensor:
        return runner(self.head, images, r)


class RelaxedGuardRunner:
    """The relaxed importance_tome model's output of ``task`` on ``images`` at ``r`` with ``head``."""

    def __init__(self, backbone: Backbone, task: str, relax: Relaxation, score_layer: int):
        self.backbone, self.reduced, self.key = backbone, backbone.forwards(task)[1], output_key(task)
        self.method, self.score_layer = RelaxedImportanceToMe(relax), score_layer

    def __call__(self, head: nn.Module, images: torch.Tensor, r: int) -> torch.Tensor:
        options = ReductionOptions(strategy="importance_tome", head=head, r=int(r), score_layer=self.score_layer)
        reduction = pareto.resolve(options, self.backbone)
        return self.reduced(dataclasses.replace(reduction, method=self.method), images)[self.key]


@dataclass
class FinetuneTask:
    """The :class:`~pullback_ext.metric.training.Task` of the fine-tune: the relaxed model's distortion."""

    runner: RelaxedGuardRunner
    task: str
    budgets: tuple
    kind: str = dataclasses.field(default="finetune", init=False)

    def loss(self, model, batch: dict, indices, step: int):
        r = self.budgets[step % len(self.budgets)]
        d = distortion_x100(self.task, model(self.runner, batch["images"], r), batch["target"])
        return d.mean(), {"r": float(r)}


def finetune(model, head: nn.Module, head_config: dict, images: torch.Tensor, config: FinetuneConfig, out: Path,
             resume: bool = False, progress: bool = True, on_step=None, backbone: Optional[Backbone] = None,
             extra: Optional[dict] = None) -> nn.Module:
    """Fine-tune a copy of the importance ``head`` (``head_config``: its checkpoint's config) for the
    frozen ``model`` on ``images [n, 3, H, W]``; the head checkpoint in ``out``, the loop's in
    ``out/training``. ``backbone``: the model's view (None: ``model`` is the demo model); ``extra``:
    stored in the ``finetune`` record (the model and images it was trained on)."""
    from pullback_ext.comparison.backbones import demo_backbone
    from pullback_ext.metric import checkpoint
    from pullback_ext.metric.training import fit

    backbone = demo_backbone(model) if backbone is None else backbone
    if config.task not in backbone.tasks:
        raise PullbackError(f"--task: {backbone.name} serves {', '.join(backbone.tasks)}; got {config.task!r}")
    if head_config.get("kind") != "head":
        raise PullbackError(f"--init-head: expected an importance head checkpoint, got kind {head_config.get('kind')!r}")
    score_layer = score_layer_of(head_config)
    model.eval().requires_grad_(False)
    torch.manual_seed(config.train.seed)
    trained = Finetuned(copy.deepcopy(head).train().requires_grad_(True))
    data = {"images": images, "target": targets(backbone, config.task, images)}
    task = FinetuneTask(RelaxedGuardRunner(backbone, config.task, config.relax, score_layer), config.task, config.budgets)
    settings = {"task": config.task, "budgets": list(config.budgets), "score_layer": score_layer, **asdict(config.relax),
                "train": asdict(train_config(config.train)), **(extra or {})}
    fit(task, trained, data, train_config(config.train), Path(out) / TRAINING_FOLDER, extra_config={"finetune": settings},
        resume=resume, progress=progress, on_step=on_step, classes={"finetune": Finetuned})
    tuned = trained.head.eval().requires_grad_(False)
    kept = {k: v for k, v in head_config.items() if k not in _REPLACED}
    checkpoint.save_model(out, "head", tuned, extra=kept | {"finetune": settings})
    return tuned
