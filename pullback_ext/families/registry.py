"""The family table: every module of this package that exports ``ADAPTER`` is one family.

A new family is one new module (``pullback_ext/families/<name>.py`` defining ``ADAPTER``, an
:class:`~pullback_ext.families.adapter.HFFamily` or :class:`~pullback_ext.families.adapter.TimmFamily`);
:func:`table` finds it by walking the package, :func:`detect` tries it in ``priority`` order.
"""

from __future__ import annotations

import importlib
import pkgutil

from pullback_ext.errors import PullbackError


def table() -> dict:
    """``{name: adapter}`` of every family module of the package, in detection order (``priority``, then name)."""
    import pullback_ext.families as package

    adapters = []
    for info in pkgutil.iter_modules(package.__path__):
        adapter = getattr(importlib.import_module(f"{package.__name__}.{info.name}"), "ADAPTER", None)
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
