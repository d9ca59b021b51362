"""The embedded demo: a small trained ViT with a CLS head and a DPT depth head, and its scenes.

- ``load(weights=None)``: the trained :class:`~pullback_ext.demo.model.DemoModel` in eval mode.
- ``heldout(n, seed)``: rendered scenes from a seed range disjoint from the training data.
- ``pullback_ext.demo.scenes``: the renderer; ``pullback_ext.demo.probes``: probe maps;
  ``python -m pullback_ext.demo.train``: the training run that produced the shipped weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pullback_ext.demo.model import DemoModel


def load(weights: str | Path | None = None) -> "DemoModel":
    """Build the demo model and load ``weights`` (default: the shipped file); eval mode, float32.

    Raises ``pullback_ext.errors.CheckpointError`` naming the file when it is missing, corrupt
    or does not fit the model.
    """
    from pullback_ext.demo.model import DemoModel
    from pullback_ext.demo.weights_io import WEIGHTS_FILE, load_weights

    model = DemoModel()
    load_weights(model, Path(weights) if weights is not None else WEIGHTS_FILE)
    return model.eval().requires_grad_(False)


def heldout(n: int, seed: int = 0, size: int = 112) -> dict:
    """``n`` held-out scenes (see ``scenes.render``); seeds never used for training."""
    from pullback_ext.demo.scenes import HELDOUT_SEED_OFFSET, render

    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
    return render(n, HELDOUT_SEED_OFFSET + seed, size)
