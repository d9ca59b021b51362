"""The registry of token-reduction methods: every module of this package but :mod:`.base` (what a
method is) and :mod:`.merging` (the contract of the per-block merging methods) is one method
family and exports ``METHODS``, a tuple of :class:`~pullback_ext.prune.methods.base.Method`
objects (one per ``strategy`` name it provides) and may set ``ORDER`` (an int, default 100), where
its methods stand in every listing.

Adding a method is adding a module here (or in a folder appended to this package's ``__path__``):
the patch functions, :class:`~pullback_ext.prune.reduction_options.ReductionOptions`, η, the
row labels, the family refusals, the command line's choices and the generated support tables all
iterate :func:`all_methods`. Modules are found with :mod:`pkgutil` and imported on first use.
"""

from __future__ import annotations

import importlib
import pkgutil

from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods.base import Method, Traits, refusal

_SKIP = ("base", "merging")
_cache: dict = {}


def all_methods() -> tuple[Method, ...]:
    """Every registered method, by the ``ORDER`` of its module, then by module name."""
    key = tuple(__path__)
    if key not in _cache:
        found: dict = {}
        modules = [importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__)
                   if info.name not in _SKIP]
        for module in sorted(modules, key=lambda m: (getattr(m, "ORDER", 100), m.__name__)):
            for method in getattr(module, "METHODS", ()):
                if method.name in found:
                    raise PullbackError(f"two token-reduction methods are named {method.name!r} ({module.__name__})")
                found[method.name] = method
        _cache.clear()
        _cache[key] = tuple(found.values())
    return _cache[key]


def names() -> tuple[str, ...]:
    """Every ``strategy`` name."""
    return tuple(m.name for m in all_methods())


def get(name: str) -> Method:
    """The method of ``strategy=name``."""
    for method in all_methods():
        if method.name == name:
            return method
    raise PullbackError(f"strategy must be one of {', '.join(names())}; got {name!r}")


def option_owners(field: str) -> tuple[str, ...]:
    """The methods that take the own option ``field``."""
    return tuple(m.name for m in all_methods() if field in m.option_names())


def supported(traits: Traits) -> tuple[str, ...]:
    """The methods a model with ``traits`` runs."""
    return tuple(m.name for m in all_methods() if refusal(m, traits) is None)


def check_supported(name: str, traits: Traits, model: str) -> None:
    """Raise unless a model with ``traits`` (``model``: what it is, in words) runs the method ``name``."""
    reason = refusal(get(name), traits)
    if reason is not None:
        runs = [get(m) for m in supported(traits)]
        originals = ", ".join(m.name for m in runs if m.kind == "original")
        others = "".join(f", and {m.name}" for m in runs if m.ours and not m.single_stage)
        hint = f" (e.g. '{name}_score')" if f"{name}_score" in names() else ""
        raise PullbackError(f"strategy {name!r} on {model}: it {reason}; this model runs the originals {originals} "
                            f"and the single-stage strategies{hint}{others}")


def support_table() -> str:
    """The markdown table of what every model family of :mod:`pullback_ext.families` runs: one row
    per family, one column per method that is not a single-stage criterion, and one for the criteria
    (a timm family's class token depends on the model: its cells assume one)."""
    from pullback_ext.families import TimmFamily, table

    shown = [m for m in all_methods() if not m.single_stage]
    criteria = [m for m in all_methods() if m.single_stage]
    lines = ["| family | " + " | ".join(m.name for m in shown) + " | single-stage criteria |",
             "|---" * (len(shown) + 2) + "|"]
    for family in table().values():
        per_model = isinstance(family, TimmFamily)
        traits = Traits.of(family)._replace(has_cls=True) if per_model else Traits.of(family)
        cells = ["yes" if refusal(m, traits) is None else f"no: {refusal(m, traits)}" for m in shown]
        refused = [m.name for m in criteria if refusal(m, traits) is not None]
        cells.append("all" if not refused else f"all but {', '.join(refused)}")
        title = family.title + (" (cells assume a class token)" if per_model else "")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
