"""Image sources by name: a folder path, or ``builtin:NAME`` for a set that ships with the package.

A plain path is always a folder. A built-in set is one entry of :data:`BUILTIN_SETS`: its name, a
one-line summary (the command-line help lists the sets from here) and a factory building its
:class:`~pullback_ext.sources.image_sets.ImageSource` without arguments. The factories import
their sources when called, so that reading the registry (as ``pullback --help`` does) loads
neither torch nor any set's optional dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from pullback_ext.errors import PullbackError

if TYPE_CHECKING:
    from pullback_ext.sources.image_sets import ImageSource

BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class BuiltinSet:
    """A registered set: ``summary`` for help texts, ``build()`` -> its ImageSource."""

    summary: str
    build: Callable[[], "ImageSource"]


def _scenes() -> "ImageSource":
    from pullback_ext.sources.scenes import SceneSource

    return SceneSource()


def _photos() -> "ImageSource":
    from pullback_ext.sources.photos import PhotoSource

    return PhotoSource()


BUILTIN_SETS: dict[str, BuiltinSet] = {
    "scenes": BuiltinSet("rendered demo scenes", _scenes),
    "photos": BuiltinSet("crops of the natural photographs in scikit-image and scikit-learn", _photos),
}


def builtin_names() -> list[str]:
    """``builtin:NAME`` for every registered set."""
    return [BUILTIN_PREFIX + name for name in BUILTIN_SETS]


def builtin_help() -> str:
    """The registered sets for a help text: ``builtin:scenes (rendered demo scenes), ...``."""
    return ", ".join(f"{BUILTIN_PREFIX}{name} ({entry.summary})" for name, entry in BUILTIN_SETS.items())


def open_images(spec: str, flag: str = "--images") -> "ImageSource":
    """The source ``spec`` names: ``builtin:NAME`` or a folder (checked to exist: DataError)."""
    from pullback_ext.sources.folders import FolderSource

    if not isinstance(spec, str) or not spec:
        raise PullbackError(f"{flag}: expected a folder or one of {', '.join(builtin_names())}, got {spec!r}")
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_SETS:
            raise PullbackError(f"{flag}: no built-in image set {spec!r}; expected a folder or one of {', '.join(builtin_names())}")
        return BUILTIN_SETS[name].build()
    return FolderSource(spec, flag)
