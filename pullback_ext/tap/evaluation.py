"""Held-out quality of a trained TAP register on the demo model, deployed (tokens really removed)."""

from __future__ import annotations

from typing import Sequence

import torch

from pullback_ext.prune import timm_vit
from pullback_ext.prune.pipeline import run_blocks
from pullback_ext.prune.reduction_options import ReductionOptions
from pullback_ext.tap.register import TaskRegister
from pullback_ext.tap.training import decode, distortion, targets


@torch.no_grad()
def pruned_outputs(model, register: TaskRegister, images: torch.Tensor, rho: float) -> torch.Tensor:
    """The demo's embedding (cls) or depth (depth register) with TAP deployed at keep rate ``rho``."""
    bb = model.backbone
    reduction = ReductionOptions(strategy="tap", head=register, ratio=1.0 - rho).resolve(timm_vit.backbone_shape(bb))
    final, hooked = run_blocks(reduction, model.embed(images), bb.blocks, timm_vit.call_block, timm_vit.attention_probs,
                               take=set(model.hook_layers))
    return decode(model, register.task, final, hooked)


def heldout_report(model, register: TaskRegister, images: torch.Tensor, rhos: Sequence[float]) -> list[dict]:
    """Mean distortion ×100 against the unpruned original model at each keep rate (ρ = 1: nothing
    removed, the register and TAP-J's adapters alone) — CLS ``100·(1 − cos)``, depth SILog ×100."""
    register.eval()
    full = targets(model, register.task, images)
    metric = "cosine x100" if register.task == "cls" else "SILog x100"
    rows = []
    for rho in rhos:
        d = distortion(register.task, pruned_outputs(model, register, images, rho), full)
        rows.append({"rho": float(rho), "metric": metric, "value": float(100 * d.mean()), "images": int(len(images))})
    return rows
