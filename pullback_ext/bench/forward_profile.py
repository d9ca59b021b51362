"""Where one call's time goes, from ``torch.profiler``: matmuls, attention, this extension's ops and
everything else.

Every profiled operator's *self* time (CPU time on the CPU; on CUDA the device time of the kernels
it launched itself) is credited to the category of its outermost classified caller, itself
included: an ``aten::t`` that ``aten::linear`` calls is matmul time, the matmuls and softmax of
SDPA's math path are attention time, whatever an op of this extension dispatches inside is that
op's. The categories:

- ``matmul``: ``aten::linear``, ``matmul``, ``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``einsum``, …
  and the convolutions (a ViT's patch embedding is one strided convolution, a GEMM);
- ``attention``: the ``aten::`` ops whose name says attention (``scaled_dot_product_attention``
  and the fused kernels it picks: ``_scaled_dot_product_flash_attention_for_cpu``,
  ``_efficient_attention_forward``, …);
- ``ours``: ``pullback_ext::`` ops;
- ``other``: the rest (layer norms, GELU, residual adds, copies, ToMe's similarity bookkeeping…),
  also given by the outermost op that spent it (``top_other``).

The call's wall time less the operators' self time is ``outside_us``: on the CPU the Python and
dispatch time between operators (what a launch-bound forward pays on top of its ops), on CUDA the
time the device sat idle between kernels. The profiler's own cost per operator inflates both a
little.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Iterable, Optional

CATEGORIES = ("matmul", "attention", "ours", "other")
LABELS = {"matmul": "matmuls and linear layers", "attention": "attention (SDPA)", "ours": "this extension's ops",
          "other": "everything else"}
MATMUL_OPS = frozenset({
    "aten::linear", "aten::matmul", "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm",
    "aten::_addmm_activation", "aten::einsum", "aten::mv", "aten::addmv", "aten::dot", "aten::conv2d",
    "aten::convolution", "aten::_convolution", "aten::mkldnn_convolution", "aten::cudnn_convolution",
    "aten::_scaled_mm", "aten::mkldnn_linear"})


def op_category(name: str) -> Optional[str]:
    """The category of one operator by its profiler name (None: not one of the named three)."""
    if name.startswith("pullback_ext::"):
        return "ours"
    if name.startswith("aten::") and ("attention" in name or "scaled_dot_product" in name):
        return "attention"
    if name in MATMUL_OPS:
        return "matmul"
    return None


def _chain(event) -> list:
    """``event`` and its callers, innermost first."""
    chain = [event]
    while getattr(chain[-1], "cpu_parent", None) is not None:
        chain.append(chain[-1].cpu_parent)
    return chain


def _is_cpu_event(event) -> bool:
    kind = getattr(event, "device_type", None)
    return kind is None or getattr(kind, "name", str(kind)) == "CPU"


def time_split(events: Iterable, device_time: bool = False, wall_us: Optional[float] = None, top: int = 5) -> dict:
    """Microseconds per category of the profiled operator ``events`` (``prof.events()``: objects with
    ``name``, ``cpu_parent`` and ``self_cpu_time_total`` / ``self_device_time_total``).

    Returns ``{"us": {category: µs}, "ops_us": their sum, "wall_us", "outside_us": wall − ops (None
    without ``wall_us``), "top_other": [(outermost op, µs)] the ``top`` largest of the other time}``.
    """
    totals = dict.fromkeys(CATEGORIES, 0.0)
    others: Counter = Counter()
    for event in events:
        if not _is_cpu_event(event):
            continue  # device-side records: their time is already their launching op's self device time
        spent = float(event.self_device_time_total if device_time else event.self_cpu_time_total)
        if spent <= 0:
            continue
        chain = _chain(event)
        found = [c for c in (op_category(e.name) for e in chain) if c is not None]
        category = found[-1] if found else "other"
        totals[category] += spent
        if category == "other":
            named = [e.name for e in chain if "::" in e.name] or [chain[-1].name]
            others[named[-1]] += spent
    ops_us = sum(totals.values())
    return {"us": totals, "ops_us": ops_us, "wall_us": wall_us,
            "outside_us": None if wall_us is None else max(wall_us - ops_us, 0.0),
            "top_other": [[name, us] for name, us in others.most_common(top)]}


def ours_share(split: dict) -> Optional[float]:
    """The share of the operators' time spent in this extension's ops (None when there is none)."""
    ours, whole = split["us"]["ours"], split["ops_us"]
    return ours / whole if ours > 0 and whole > 0 else None


def profile_call(fn: Callable, *args, cuda: bool = False):
    """``torch.profiler`` over one ``fn(*args)`` under ``torch.no_grad`` (the caller warms it up):
    ``(profile, wall µs)``; with ``cuda`` the device's activities are recorded too and the call is
    timed to the device's end."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        start = time.perf_counter()
        fn(*args)
        if cuda:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    return prof, wall_us


def forward_profile(fn: Callable, *args, cuda: bool = False, calls: int = 1) -> dict:
    """``calls`` profiled ``fn(*args)``, each in its own profile, and of the one whose wall time is
    the median (a single profiled call takes whatever the machine's other load does to it whole):
    ``{"split": time_split(...), "kernel_share": ours_share, "launches": count_launches (CUDA; None
    on the CPU)}``."""
    from pullback_ext.bench.kernel_breakdown import count_launches, trace_events

    if calls < 1:
        raise ValueError(f"calls: expected a positive count, got {calls}")
    runs = sorted((profile_call(fn, *args, cuda=cuda) for _ in range(calls)), key=lambda run: run[1])
    prof, wall_us = runs[len(runs) // 2]
    split = time_split(prof.events(), device_time=cuda, wall_us=wall_us)
    return {"split": split, "kernel_share": ours_share(split),
            "launches": count_launches(trace_events(prof)) if cuda else None}


def cuda_launches(fn: Callable, *args) -> dict:
    """:func:`~pullback_ext.bench.kernel_breakdown.count_launches` of one profiled CUDA ``fn(*args)``."""
    from pullback_ext.bench.kernel_breakdown import count_launches, trace_events

    return count_launches(trace_events(profile_call(fn, *args, cuda=True)[0]))
