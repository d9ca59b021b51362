"""Access to the project's fused ops (``pullback_ext.ops``) while that module may be absent."""

from __future__ import annotations

import importlib
from typing import Callable, Optional


def kernel(name: str) -> Optional[Callable]:
    """``pullback_ext.ops.<name>``, or None when the ops module is not part of the installed package."""
    try:
        ops = importlib.import_module("pullback_ext.ops")
    except ModuleNotFoundError as exc:
        if exc.name != "pullback_ext.ops":
            raise
        return None
    return getattr(ops, name)
