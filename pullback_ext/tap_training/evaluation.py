"""Held-out quality of a trained TAP register, deployed (tokens really removed), on any
:class:`~pullback_ext.comparison.backbones.Backbone`."""

from __future__ import annotations

from typing import Sequence

import torch

from pullback_ext.comparison.backbones import Backbone
from pullback_ext.prune.methods.tap import TAP
from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions
from pullback_ext.tap.register import TaskRegister
from pullback_ext.tap_training.training import distortion, targets


@torch.no_grad()
def pruned_outputs(backbone: Backbone, register: TaskRegister, images: torch.Tensor, rho: float) -> torch.Tensor:
    """The backbone's embedding (cls register) or depth (depth register) with TAP deployed at keep rate ``rho``."""
    shape = BackboneShape(depth=backbone.depth, num_prefix=backbone.num_prefix, has_cls=backbone.has_cls)
    reduction = ReductionOptions(strategy=TAP.name, head=register, ratio=1.0 - rho).resolve(shape)
    return backbone.reduced(reduction, images)["embedding" if register.task == "cls" else "depth"]


def heldout_report(backbone: Backbone, register: TaskRegister, images: torch.Tensor, rhos: Sequence[float]) -> list[dict]:
    """Mean distortion ×100 against the unpruned original model at each keep rate (ρ = 1: nothing
    removed, the register and TAP-J's adapters alone) — CLS ``100·(1 − cos)``, depth SILog ×100."""
    register.eval()
    full = targets(backbone, register.task, images)
    metric = "cosine x100" if register.task == "cls" else "SILog x100"
    rows = []
    for rho in rhos:
        d = distortion(register.task, pruned_outputs(backbone, register, images, rho), full)
        rows.append({"rho": float(rho), "metric": metric, "value": float(100 * d.mean()), "images": int(len(images))})
    return rows
