"""Comma-separated numeric command-line values, validated with the option named in errors."""

from __future__ import annotations

from pullback_ext.errors import PullbackError


def comma_floats(text: str, name: str) -> tuple:
    """``"0.1,0.2"`` -> ``(0.1, 0.2)``; ``name`` is the option, for the error message."""
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise PullbackError(f"{name} must be comma-separated numbers; got {text!r}") from None
    if not values:
        raise PullbackError(f"{name} must name at least one value")
    return values


def comma_ints(text: str, name: str) -> tuple:
    """``"1,64"`` -> ``(1, 64)``: positive integers only."""
    values = comma_floats(text, name)
    if any(v != int(v) or v < 1 for v in values):
        raise PullbackError(f"{name} must be positive integers; got {text!r}")
    return tuple(int(v) for v in values)
