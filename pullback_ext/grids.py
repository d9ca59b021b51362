"""The patch grid of a token sequence: a low-level helper shared by the compute code (token
reduction, TAP) and the figures."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from pullback_ext.errors import PullbackError


def grid_shape(num_patch_tokens: int, grid_size: Optional[Sequence[int]] = None) -> tuple[int, int]:
    """(h, w) of the patch grid holding ``num_patch_tokens`` tokens (h · w of them): ``grid_size``
    if given, else the square root of the token count."""
    if grid_size is not None:
        h, w = int(grid_size[0]), int(grid_size[1])
    else:
        h = w = int(round(math.sqrt(num_patch_tokens)))
    if h * w != num_patch_tokens:
        raise PullbackError(f"grid_size: {num_patch_tokens} patch tokens do not fill a {h}×{w} grid")
    return h, w
