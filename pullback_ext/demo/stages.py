"""What the stages of ``pullback demo`` take and give: every stage module exposes ``NAME`` and
``run_demo_stage(inputs: DemoInputs) -> StageResult``; values a later stage needs (a trained
importance head) travel in the result, not through the output folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from pullback_ext.sources.image_sets import ImageSource
from pullback_ext.sources.preprocess import Preprocess


@dataclass(frozen=True)
class TrainedHead:
    """An importance head trained by a stage: it scores the tokens entering stage ``layer`` (its
    probe layer + 1) for ``task`` ("cls" or "depth")."""

    task: str
    head: torch.nn.Module
    layer: int


@dataclass(frozen=True)
class DemoInputs:
    """The demo model and its ``preprocess``, the scene ``images`` source, the held-out ``scenes``
    (``images [n,3,H,W]``, ``labels [n]``, ``depth [n,H,W]``, ``classes [n,H,W]``), where stages
    write (``out_dir``), the run size (``quick``), the model's ``segmentation_head`` (None: the
    shipped one was trained for other weights) and the ``heads`` earlier stages trained."""

    model: torch.nn.Module
    preprocess: Preprocess
    images: ImageSource
    scenes: dict
    out_dir: Path
    quick: bool
    segmentation_head: Optional[torch.nn.Module] = None
    heads: tuple[TrainedHead, ...] = ()


@dataclass(frozen=True)
class StageResult:
    """A stage's JSON-able ``report`` (written to results.json) and the ``heads`` it trained."""

    report: dict
    heads: tuple[TrainedHead, ...] = field(default=())
