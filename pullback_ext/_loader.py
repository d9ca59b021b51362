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


# A wheel's local version names the torch it was built for (0.1.0+pt2.14cu130: torch 2.14, CUDA 13.0).
_REMEDY = ("install the pullback_ext wheel whose local version names the running torch (+ptX.YcuZZZ or +ptX.Ycpu), "
           "or rebuild with `pip install --no-build-isolation --force-reinstall -e .`")


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
    built_cuda = info.CUDA_VERSION if info.WITH_CUDA else None
    if _base_version(built) != _base_version(running) or (built_cuda is not None and built_cuda != torch.version.cuda):
        raise BuildMismatchError(
            f"pullback_ext._C was built against torch {built} (CUDA kernels: {built_cuda or 'none'}) but torch "
            f"{running} (CUDA {torch.version.cuda or 'none'}) is running; {_REMEDY}"
        )
    try:
        return importlib.import_module("pullback_ext._C")
    except ImportError as exc:
        raise BuildMismatchError(
            f"pullback_ext._C failed to load ({exc}); it was built for torch {built}"
            f" (CUDA {info.CUDA_VERSION}) and torch {running} (CUDA {torch.version.cuda}) is running; {_REMEDY}"
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
