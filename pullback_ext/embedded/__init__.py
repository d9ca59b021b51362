"""The embedded demo model: a small trained ViT with a CLS head and a DPT depth head, its shipped
weights, a DPT segmentation head trained on the frozen backbone, and the scene renderer they were
trained on. This is library code (a model source like
``timm:NAME`` or ``hf:DIR``); ``pullback_ext.demo`` is the application that runs the whole
pipeline on it.

- ``load(weights=None)``: the trained :class:`~pullback_ext.embedded.model.DemoModel` in eval mode.
- ``load_segmentation_head(weights=None, model=None)``: the trained
  :class:`~pullback_ext.embedded.model.SegmentationHead` (eval mode): hooked token maps ->
  logits over ground, wall and the nine object classes (``model.segment(images, head)``).
- ``heldout(n, seed)``: rendered scenes from a seed range disjoint from the training data.
- ``pullback_ext.embedded.scenes``: the renderer; ``pullback_ext.embedded.probes``: probe maps.
  The training run that produced the shipped weights is ``python -m pullback_ext.demo.train``;
  the segmentation head's is ``python -m pullback_ext.demo.train_segmentation``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from pullback_ext.errors import PullbackError

if TYPE_CHECKING:
    from pullback_ext.embedded.model import DemoModel, SegmentationHead


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


def load_segmentation_head(weights: str | Path | None = None, model: "DemoModel | None" = None) -> "SegmentationHead":
    """Build the demo's segmentation head and load ``weights`` (default: the shipped file); eval
    mode, float32, no gradients.

    ``model``: the demo model it will decode; the file records the digest of the backbone weights
    the head was trained on, and a model with other weights is refused (its hooked features are
    not the ones the head learned). Raises ``pullback_ext.errors.CheckpointError`` naming the file
    when it is missing, corrupt, does not fit the head, or was trained for other weights.
    """
    from pullback_ext.embedded.model import SegmentationHead
    from pullback_ext.embedded.weights_io import SEGMENTATION_FILE, load_weights, read_metadata, weights_digest
    from pullback_ext.errors import CheckpointError

    path = Path(weights) if weights is not None else SEGMENTATION_FILE
    head = SegmentationHead()
    load_weights(head, path, what=f"the demo segmentation head ({head.num_classes} classes)")
    if model is not None:
        trained_for = read_metadata(path).get("backbone_weights")
        if trained_for is not None and trained_for != weights_digest(model):
            raise CheckpointError(f"weights: {path}: the segmentation head was trained for demo weights {trained_for}, "
                                  f"the model has {weights_digest(model)}; retrain it with "
                                  "python -m pullback_ext.demo.train_segmentation")
    return head.eval().requires_grad_(False)


def heldout(n: int, seed: int = 0, size: int = 112, classes: bool = False) -> dict:
    """``n`` held-out scenes (see ``scenes.render``; ``classes``: with the per-pixel class map);
    seeds never used for training."""
    from pullback_ext.embedded.scenes import HELDOUT_SEED_OFFSET, render

    if not isinstance(seed, int) or seed < 0:
        raise PullbackError(f"seed: expected a non-negative int, got {seed!r}")
    return render(n, HELDOUT_SEED_OFFSET + seed, size, classes=classes)
