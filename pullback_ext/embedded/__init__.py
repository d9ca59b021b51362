"""The embedded demo model: a small trained ViT with a CLS head and a DPT depth head, its shipped
weights and the scene renderer it was trained on. This is library code (a model source like
``timm:NAME`` or ``hf:DIR``); ``pullback_ext.demo`` is the application that runs the whole
pipeline on it.

- ``load(weights=None)``: the trained :class:`~pullback_ext.embedded.model.DemoModel` in eval mode.
- ``heldout(n, seed)``: rendered scenes from a seed range disjoint from the training data.
- ``pullback_ext.embedded.scenes``: the renderer; ``pullback_ext.embedded.probes``: probe maps.
  The training run that produced the shipped weights is ``python -m pullback_ext.demo.train``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from pullback_ext.errors import PullbackError

if TYPE_CHECKING:
    from pullback_ext.embedded.model import DemoModel


def load(weights: str | Path | None = None) -> "DemoModel":
    """Build the demo model and load ``weights`` (default: the shipped file); eval mode, float32.

    Raises ``pullback_ext.errors.CheckpointError`` naming the file when it is missing, corrupt
    or does not fit the model.
    """
    from pullback_ext.embedded.model import DemoModel
    from pullback_ext.embedded.weights_io import WEIGHTS_FILE, load_weights

    model = DemoModel()
    load_weights(model, Path(weights) if weights is not None else WEIGHTS_FILE)
    return model.eval().requires_grad_(False)


def heldout(n: int, seed: int = 0, size: int = 112) -> dict:
    """``n`` held-out scenes (see ``scenes.render``); seeds never used for training."""
    from pullback_ext.embedded.scenes import HELDOUT_SEED_OFFSET, render

    if not isinstance(seed, int) or seed < 0:
        raise PullbackError(f"seed: expected a non-negative int, got {seed!r}")
    return render(n, HELDOUT_SEED_OFFSET + seed, size)
