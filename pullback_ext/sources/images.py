"""Image sources by name: a folder path, or ``builtin:NAME`` for a set that ships with the package.

A plain path is always a folder. A built-in set is one entry of :data:`BUILTIN_SETS`: its name
and a class implementing :class:`~pullback_ext.sources.image_sets.ImageSource`, built without arguments.
"""

from __future__ import annotations

from pullback_ext.errors import PullbackError
from pullback_ext.sources.folders import FolderSource
from pullback_ext.sources.image_sets import ImageSource
from pullback_ext.sources.scenes import SceneSource

BUILTIN_PREFIX = "builtin:"
BUILTIN_SETS: dict[str, type[ImageSource]] = {
    "scenes": SceneSource,
}


def builtin_names() -> list[str]:
    """``builtin:NAME`` for every registered set."""
    return [BUILTIN_PREFIX + name for name in BUILTIN_SETS]


def open_images(spec: str, flag: str = "--images") -> ImageSource:
    """The source ``spec`` names: ``builtin:NAME`` or a folder (checked to exist: DataError)."""
    if not isinstance(spec, str) or not spec:
        raise PullbackError(f"{flag}: expected a folder or one of {', '.join(builtin_names())}, got {spec!r}")
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_SETS:
            raise PullbackError(f"{flag}: no built-in image set {spec!r}; expected a folder or one of {', '.join(builtin_names())}")
        return BUILTIN_SETS[name]()
    return FolderSource(spec, flag)
