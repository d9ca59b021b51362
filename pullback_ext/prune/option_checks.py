"""Checks of single option values, shared by :mod:`pullback_ext.prune.reduction_options` and the
methods' own options: each returns the value in its one representation or raises
:class:`~pullback_ext.errors.PullbackError` naming the option and what it expects."""

from __future__ import annotations

import numbers
from typing import Optional

from pullback_ext.errors import PullbackError

# the fields of the single-stage pipeline: the originals that run their own loop take none of them
SINGLE_STAGE_FIELDS = ("ratio", "layers", "head", "spn", "matching", "eps", "weights", "selection", "llf", "preset", "recovery")


def one_of(name: str, value, choices: tuple, auto: bool = True):
    allowed = ("auto",) + choices if auto else choices
    if not isinstance(value, str) or value not in allowed:
        raise PullbackError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def count(name: str, value, least: int, optional: bool = False) -> Optional[int]:
    """An int ``>= least`` (or None when ``optional``)."""
    if optional and value is None:
        return None
    if not is_int(value) or value < least:
        raise PullbackError(f"{name} must be {'None or ' if optional else ''}an int >= {least}; got {value!r}")
    return int(value)


def layer_list(layers, name: str = "layers") -> tuple[int, ...]:
    """Block indices, strictly increasing (one int becomes a 1-tuple)."""
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = (layers,)
    try:
        values = [int(layer) for layer in layers]
        if any(isinstance(layer, bool) or int(layer) != layer for layer in layers):
            raise TypeError
    except (TypeError, ValueError):
        raise PullbackError(f"{name} must be block indices (ints); got {layers!r}") from None
    if not values:
        raise PullbackError(f"{name} must name at least one block index")
    if sorted(set(values)) != values:
        raise PullbackError(f"{name} must be strictly increasing; got {values}")
    return tuple(values)


def check_layer_range(layers: tuple, depth: int, llf_in_prune: bool, name: str = "layers") -> None:
    """Every block of ``layers`` exists in a ``depth``-block model (with prune-mode LLF, not the last)."""
    last = depth - 2 if llf_in_prune else depth - 1
    for layer in layers:
        if not 0 <= layer <= last:
            why = " (with LLF the last block always runs on the full sequence)" if llf_in_prune else ""
            raise PullbackError(f"{name} must lie in [0, {last}] for this {depth}-block model{why}; got {layer}")
