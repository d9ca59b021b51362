"""The models a study compares: the grammar of ``--model`` plus ``demo:random``, the demo
architecture at its random initialisation (seeded), the control a trained model is compared with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.sources.models import MODEL_GRAMMAR, ModelSpec, parse_model

STUDY_GRAMMAR = f"{MODEL_GRAMMAR} | demo:random"


@dataclass(frozen=True)
class StudyModel:
    """A parsed study model: ``spec`` and whether it is the untrained control (``random``, demo only)."""

    spec: ModelSpec
    random: bool = False

    def __str__(self) -> str:
        return f"{self.spec}:random" if self.random else str(self.spec)


def parse_study_model(text: str, flag: str = "--model") -> StudyModel:
    """``demo:random`` or any spelling of :func:`~pullback_ext.sources.models.parse_model`."""
    if text == "demo:random":
        return StudyModel(ModelSpec("demo"), random=True)
    try:
        return StudyModel(parse_model(text, flag))
    except PullbackError:
        raise PullbackError(f"{flag}: expected {STUDY_GRAMMAR}, got {text!r}") from None


def random_demo(seed: int):
    """The demo model's architecture with the random initialisation drawn from ``seed``; eval mode."""
    from pullback_ext.embedded.model import DemoModel

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DemoModel()
    return model.eval().requires_grad_(False)


def random_demo_weights(seed: int, folder: Path) -> Path:
    """``random_demo(seed)``'s weights as ``folder/demo-random-seed-S.safetensors`` (float32, so
    loading them gives the initialisation bit for bit), for the commands that take ``--weights``."""
    from safetensors.torch import save_file

    from pullback_ext.fileio import atomic_path

    path = Path(folder) / f"demo-random-seed-{seed}.safetensors"
    state = {k: v.contiguous() for k, v in random_demo(seed).state_dict().items()}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp))
    return path


def study_weights(model: StudyModel, weights: Optional[str], seed: int, folder: Path) -> Optional[str]:
    """The weights file that builds ``model`` by its spec: ``weights`` for a trained model, the
    initialisation's file (:func:`random_demo_weights` in ``folder``) for ``demo:random``."""
    if not model.random:
        return weights
    _refuse_weights(weights)
    return str(random_demo_weights(seed, folder))


def _refuse_weights(weights: Optional[str]) -> None:
    if weights is not None:
        raise PullbackError("--weights: demo:random is the untrained architecture and takes no weights")


def load_study_backbone(model: StudyModel, weights: Optional[str], seed: int, task: Optional[str] = None):
    """``(Backbone, model)`` of a study model (see ``pullback_ext.comparison.backbones.load_backbone``;
    ``task`` ``segmentation``: the trained demo with its shipped segmentation head, whose
    backbone then lists that task; ``demo:random`` has no segmentation head)."""
    from pullback_ext.comparison.backbones import demo_backbone, load_backbone

    if model.random:
        _refuse_weights(weights)
        net = random_demo(seed)
        return demo_backbone(net), net
    return load_backbone(model.spec, weights, task)
