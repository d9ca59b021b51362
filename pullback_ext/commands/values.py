"""Shared command-line pieces: the backbone/image options of ``evaluate`` and ``subprobe``, and
comma-separated numeric values validated with the option named in errors."""

from __future__ import annotations

import argparse

from pullback_ext.errors import PullbackError


def add_backbone_arguments(parser: argparse.ArgumentParser, model_help: str, images_help: str, count_help: str) -> None:
    """``--demo | --model NAME``, ``--weights``, ``--images``, ``--num-images`` as one group."""
    src = parser.add_argument_group("model and images")
    src.add_argument("--demo", action="store_true", help="the embedded demo model on held-out demo scenes")
    src.add_argument("--model", help=model_help)
    src.add_argument("--weights", help="backbone weights: demo weights file with --demo, a state dict (.pth/.safetensors) with --model "
                     "(hf:DIR: default the folder's own)")
    src.add_argument("--images", help=images_help)
    src.add_argument("--num-images", type=int, default=32, help=count_help)


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
