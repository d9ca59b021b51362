"""``--layers all|LIST``: the layers a study sweeps, 0-based blocks of the model at hand."""

from __future__ import annotations

from pullback_ext.errors import PullbackError


def parse_layers(text: str, first: int, last: int, flag: str = "--layers") -> tuple[int, ...]:
    """``"all"`` -> ``first..last``; ``"0,3,5"`` -> ``(0, 3, 5)`` (sorted). Every index must lie in
    ``[first, last]`` and appear once; a bad list is a PullbackError that gives the valid range."""
    valid = f"valid layers are {first}..{last} (0-based blocks; 'all' takes every one)"
    if not isinstance(text, str) or not text.strip():
        raise PullbackError(f"{flag}: expected 'all' or a comma list of layers, got an empty value; {valid}")
    if text.strip() == "all":
        return tuple(range(first, last + 1))
    parts = [p.strip() for p in text.split(",")]
    if any(not p.lstrip("-").isdigit() for p in parts):
        raise PullbackError(f"{flag}: expected 'all' or a comma list of integers, got {text!r}; {valid}")
    layers = [int(p) for p in parts]
    outside = [layer for layer in layers if not first <= layer <= last]
    if outside:
        raise PullbackError(f"{flag}: layer {outside[0]} is out of range; {valid}")
    repeated = sorted({layer for layer in layers if layers.count(layer) > 1})
    if repeated:
        raise PullbackError(f"{flag}: layer {repeated[0]} is named twice in {text!r}; {valid}")
    return tuple(sorted(layers))
