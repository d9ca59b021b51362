"""Loads the compiled core ``pullback_ext._C`` and checks that it matches the running torch.

A build made against another torch would crash or fail with an unreadable linker message; this
module turns that into one clear error. When the package was never compiled (a plain source
checkout), ``load_compiled()`` returns ``None`` and the ops fall back to the pure-torch reference.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import torch


class BuildMismatchError(ImportError):
    """The compiled extension was built for a different torch than the one running."""


def _base_version(version: str) -> str:
    return version.split("+")[0]


@functools.lru_cache(maxsize=None)
def load_compiled():
    """Return the ``pullback_ext._C`` module, or ``None`` when the package was not compiled."""
    try:
        info = importlib.import_module("pullback_ext._build_info")
    except ImportError:
        warnings.warn(
            "pullback_ext was not compiled (no _build_info); using the pure-torch reference ops. "
            "Build with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    built, running = info.TORCH_VERSION, torch.__version__
    if _base_version(built) != _base_version(running):
        raise BuildMismatchError(
            f"pullback_ext._C was built against torch {built} but torch {running} is running; "
            "rebuild with `pip install --no-build-isolation --force-reinstall -e .`"
        )
    try:
        return importlib.import_module("pullback_ext._C")
    except ImportError as exc:
        raise BuildMismatchError(
            f"pullback_ext._C failed to load ({exc}); it was built for torch {built}"
            f" (CUDA {info.CUDA_VERSION}) and torch {running} (CUDA {torch.version.cuda}) is running"
        ) from exc


def build_info() -> dict:
    """What the compiled extension was built with: torch and CUDA versions, archs."""
    try:
        info = importlib.import_module("pullback_ext._build_info")
    except ImportError:
        return {"compiled": False}
    return {
        "compiled": True,
        "torch_version": info.TORCH_VERSION,
        "cuda_version": info.CUDA_VERSION,
        "with_cuda": info.WITH_CUDA,
        "cuda_archs": info.CUDA_ARCHS,
    }
