"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: a dispatch mode that fails on
every operator that reads tensor values back to Python or whose output shape depends on them.

On a CUDA tensor each of these waits for the device: ``aten._local_scalar_dense`` is what
``.item()``, ``bool(t)``, ``int(t)``, ``float(t)`` and ``if t:`` call; ``nonzero``,
``masked_select``, ``unique`` and indexing with a boolean mask (reading or assigning) size their
output from the data. The mode sees the operators the Python code calls, not what a compiled
kernel does inside (the custom ops are seen as one call), and not ``Tensor.tolist()`` of a CPU
tensor, which reads memory without dispatching an operator.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = {
    "aten::_local_scalar_dense", "aten::nonzero", "aten::nonzero_static", "aten::masked_select", "aten::_unique",
    "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
}
INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}  # sync with a bool index


class HostSyncError(AssertionError):
    """An operator that would synchronise a CUDA device with the host ran."""


class NoHostSync(TorchDispatchMode):
    """Raise :class:`HostSyncError` when an operator of :data:`SYNCING` runs inside the ``with`` block."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in SYNCING or (name in INDEXING and _has_mask_index(args)):
            raise HostSyncError(f"{name} reads tensor values on the host")
        return func(*args, **(kwargs or {}))


def _has_mask_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def assert_detects_sync() -> None:
    """Check the guard itself: ``.item()``, ``bool()``, ``int()``, ``nonzero`` and mask indexing
    (reading and assigning) are caught."""
    t = torch.ones(3)
    def assign():
        t[t > 5] = 0

    for read in (lambda: t.sum().item(), lambda: bool(t.sum() > 0), lambda: int(t.sum()), lambda: t.nonzero(),
                 lambda: t[t > 0], assign):
        try:
            with NoHostSync():
                read()
        except HostSyncError:
            continue
        raise AssertionError("NoHostSync missed a host read")
