"""pullback_ext: task-induced (pullback) geometry of Vision Transformer feature spaces.

Submodules are imported on first use so that ``import pullback_ext`` stays cheap:

- ``pullback_ext.ops`` / ``pullback_ext.reference``: fused kernels and their pure-torch oracles
- ``pullback_ext.probes``, ``pullback_ext.linalg``, ``pullback_ext.diagnose``: the diagnostic
- ``pullback_ext.metric``: Spectral Pullback Network, importance head, VAE bottleneck
- ``pullback_ext.patch``, ``pullback_ext.prune``: token merging and pruning
- ``pullback_ext.visualize``: pictures of the merges (which patch positions share a token, per block)
- ``pullback_ext.embedded``: the embedded demo model (a small trained ViT, its decoders and scenes)
- ``pullback_ext.demo``: the application that runs the whole pipeline on it (``pullback demo``)
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = {"ops", "reference", "probes", "linalg", "metric", "patch", "prune", "embedded", "demo", "diagnostics", "visualize"}
_ATTRS = {
    "diagnose": ("pullback_ext.diagnostics", "diagnose"),
    "Diagnosis": ("pullback_ext.diagnostics", "Diagnosis"),
    "DiagnoseConfig": ("pullback_ext.diagnostics", "DiagnoseConfig"),
    "build_info": ("pullback_ext._loader", "build_info"),
}

__all__ = sorted(_SUBMODULES | set(_ATTRS) | {"__version__"})


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"pullback_ext.{name}")
    if name in _ATTRS:
        module, attr = _ATTRS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'pullback_ext' has no attribute {name!r}")
