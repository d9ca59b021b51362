"""Stage schedules: the ViT-B (12-block) layer lists of the paper mapped to other depths.

With Last-Layer Fusion the final block always runs on the full sequence, so the prunable input
layers of a ViT-B are 0..10; a schedule maps that range linearly onto ``0..depth-2`` (the identity
for 12 blocks), keeping the layers strictly increasing.
"""

from __future__ import annotations

from typing import Sequence

from pullback_ext.errors import PullbackError

REFERENCE_DEPTH = 12
NAMED = {"1stage": (4,), "2stage": (4, 8), "4stage": (1, 4, 7, 10)}


def scale_layers(layers: Sequence[int] | str, depth: int, reference_depth: int = REFERENCE_DEPTH) -> tuple:
    """Map stage layers given for a ``reference_depth``-block ViT to a ``depth``-block one.

    ``layers``: ints, or a name in ``NAMED`` (``1stage``, ``2stage``, ``4stage``).
    >>> scale_layers((4, 8), 12), scale_layers((4, 8), 8), scale_layers("4stage", 24)
    ((4, 8), (2, 5), (2, 9, 15, 22))
    """
    if isinstance(layers, str):
        if layers not in NAMED:
            raise PullbackError(f"schedule must be one of {', '.join(NAMED)} or a list of layers; got {layers!r}")
        layers = NAMED[layers]
    if depth < 3 or reference_depth < 3:
        raise PullbackError(f"depth must be at least 3 blocks to scale a schedule; got {depth}")
    src_last, dst_last = reference_depth - 2, depth - 2
    out: list[int] = []
    for layer in layers:
        if not 0 <= int(layer) <= src_last:
            raise PullbackError(f"schedule layers must lie in [0, {src_last}] for a {reference_depth}-block reference; got {layer}")
        scaled = int(int(layer) * dst_last / src_last + 0.5)
        if out and scaled <= out[-1]:
            scaled = out[-1] + 1
        if scaled > dst_last:
            raise PullbackError(f"schedule {tuple(layers)} has more stages than a {depth}-block model can hold")
        out.append(scaled)
    return tuple(out)


def parse_layers(text: str) -> tuple:
    """``"4,8"`` -> (4, 8); a schedule name passes through unchanged as a string."""
    text = text.strip()
    if text in NAMED:
        return NAMED[text]
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise PullbackError(f"--stages must be comma-separated block indices or one of {', '.join(NAMED)}; got {text!r}") from None
