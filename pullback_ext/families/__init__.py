"""Model families: one adapter per family (timm ViT, timm Eva, Hugging Face ViT, CLIP, SigLIP,
DINOv2, DINOv3, DPT, Depth Anything), each holding everything about that family that the patches,
probes, model sources and TAP training need, and :func:`detect`, which says which family a model
is of. A low-level package: it imports torch, the errors and (lazily) timm and transformers only.

The family table: every module of this package that exports ``ADAPTER`` is one family. A new
family is one new module (``pullback_ext/families/<name>.py`` defining ``ADAPTER``, an
:class:`~pullback_ext.families.adapter.HFFamily` or :class:`~pullback_ext.families.adapter.TimmFamily`,
or one in a folder appended to this package's ``__path__``); :func:`table` finds it by walking the
package, :func:`detect` tries it in ``priority`` order. The table lives in the package face because
the walk reads the face's ``__path__``.
"""

from __future__ import annotations

import importlib
import pkgutil

from pullback_ext.errors import PullbackError
from pullback_ext.families.adapter import AttentionLayout, Branches, HFFamily, ProbeReadout, TimmFamily
from pullback_ext.families.versions import CHECKED_TRANSFORMERS, check_transformers

__all__ = ["AttentionLayout", "Branches", "CHECKED_TRANSFORMERS", "HFFamily", "ProbeReadout", "TimmFamily",
           "check_transformers", "detect", "family", "supported", "table"]


def table() -> dict:
    """``{name: adapter}`` of every family module of the package, in detection order (``priority``, then name)."""
    adapters = []
    for info in pkgutil.iter_modules(__path__):
        adapter = getattr(importlib.import_module(f"{__name__}.{info.name}"), "ADAPTER", None)
        if adapter is not None:
            adapters.append(adapter)
    return {adapter.name: adapter for adapter in sorted(adapters, key=lambda a: (a.priority, a.name))}


def family(name: str):
    """The adapter of the family ``name``."""
    adapters = table()
    if name not in adapters:
        raise PullbackError(f"family: expected one of {', '.join(adapters)}, got {name!r}")
    return adapters[name]


def supported(names=None) -> str:
    """The families ``names`` (default: all) in words, as the messages list them."""
    adapters = [a for a in table().values() if names is None or a.name in names]
    return "; ".join(a.title if a.listing is None else a.listing for a in adapters if a.listing != "")


def detect(model, names=None, who: str = "model"):
    """The adapter of ``model``'s family: the first of ``names`` (default: every family), in
    detection order, that recognises it; otherwise a PullbackError, starting with ``who``, naming the
    families."""
    adapters = [a for a in table().values() if names is None or a.name in names]
    found = next((a for a in adapters if a.matches(model)), None)
    if found is None:
        which = "supported" if names is None else "expected"
        raise PullbackError(f"{who}: {type(model).__name__} is none of the {which} families: {supported(names)}")
    return found
