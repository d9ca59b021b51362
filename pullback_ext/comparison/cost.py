"""Cost of a forward pass: theoretical FLOPs (torch's flop counter) and wall-clock time."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from pullback_ext.comparison.tasks import TASKS
from pullback_ext.errors import PullbackError

FLOP_ACCOUNTING = ("FLOPs per image: torch's flop counter (torch.utils.flop_counter) over the task's whole forward at "
                   "batch 1, the same for every method: the backbone with the method's scoring, matching and importance "
                   "head, and the task's decoder (" + "; ".join(f"{'CLS' if t.name == 'cls' else t.name}: {t.decoder}"
                                                              for t in TASKS.values()) +
                   "); the other tasks' decoders are not counted.")


def count_flops(fn: Callable, *args) -> int:
    """Total FLOPs of ``fn(*args)`` as counted by ``torch.utils.flop_counter`` (no grad), with the
    fused attention of CPU runs counted too (torch's counter has no formula for it)."""
    from torch.utils.flop_counter import FlopCounterMode

    extra = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=extra) as counter:
        fn(*args)
    return int(counter.get_total_flops())


def _attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """``q kᵀ`` and ``softmax(·) v`` of attention on ``q [B, H, Q, d]``, ``k [B, H, K, d]``,
    ``v [B, H, K, e]``: ``2 B H Q K (d + e)``, as torch counts its other attention kernels."""
    b, h, q, d = query_shape
    k, e = key_shape[-2], value_shape[-1]
    return 2 * b * h * q * k * (d + e)


def wall_clock(fn: Callable, *args, repeats: int = 5, warmup: int = 1) -> dict:
    """Median and min seconds of ``fn(*args)`` over ``repeats`` timed runs after ``warmup``."""
    return interleaved_wall_clock({"fn": lambda: fn(*args)}, repeats=repeats, warmup=warmup)["fn"]


def interleaved_wall_clock(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                           device: torch.device | str = "cpu") -> dict[str, dict]:
    """``{name: {median_s, min_s, repeats, times_s}}`` of each ``fns[name]()``, the one timing harness
    of ``pullback evaluate`` and ``benchmarks/bench_prune.py``.

    The functions run in turn within each round (the order rotating from round to round) and each
    round is timed whole per function, so a change of machine load during the measurement affects
    every entry alike; ``warmup`` untimed rounds come first. On a CUDA ``device`` each call is timed
    with CUDA events (the device is synchronised once per call, after it), elsewhere with
    ``time.perf_counter``.
    """
    if not fns:
        return {}
    if not isinstance(repeats, int) or repeats < 1 or not isinstance(warmup, int) or warmup < 0:
        raise PullbackError(f"repeats must be an int >= 1 and warmup an int >= 0; got {repeats!r}, {warmup!r}")
    names = list(fns)
    timer = _cuda_timer if torch.device(device).type == "cuda" else _host_timer
    times: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for round_ in range(warmup + repeats):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                seconds = timer(fns[name])
                if round_ >= warmup:
                    times[name].append(seconds)
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "repeats": repeats, "times_s": t} for name, t in times.items()}


def speedup_interval(base_s, point_s, level: float = 0.9, resamples: int = 2000, seed: int = 0) -> dict:
    """Median and bootstrap interval of the per-round speed-up ``base_s[k] / point_s[k]``.

    ``base_s [R]`` and ``point_s [R]``: seconds of the unpruned model and of one reduced setting in
    the same ``R`` interleaved rounds (``times_s`` of :func:`interleaved_wall_clock`). The interval
    is the percentile bootstrap of the median: ``resamples`` draws of ``R`` rounds with replacement
    (numpy ``default_rng(seed)``), the median of each draw's ratios, and the ``(1 − level) / 2`` and
    ``(1 + level) / 2`` percentiles (numpy's linear rule) of those medians. Returns
    ``{"median", "low", "high", "rounds"}``.
    """
    import numpy as np

    base, point = np.asarray(base_s, dtype=np.float64), np.asarray(point_s, dtype=np.float64)
    if base.ndim != 1 or base.shape != point.shape or base.size < 1:
        raise PullbackError(f"speed-up interval: expected two equal-length lists of round times; got {base.shape} and {point.shape}")
    if not (base > 0).all() or not (point > 0).all():
        raise PullbackError("speed-up interval: round times must be positive")
    if not 0 < level < 1 or resamples < 1:
        raise PullbackError(f"speed-up interval: level must be in (0, 1) and resamples >= 1; got {level!r}, {resamples!r}")
    ratios = base / point
    draws = np.random.default_rng(seed).integers(0, ratios.size, size=(resamples, ratios.size))
    medians = np.median(ratios[draws], axis=1)
    low, high = np.percentile(medians, [50 * (1 - level), 50 * (1 + level)])
    return {"median": float(np.median(ratios)), "low": float(low), "high": float(high), "rounds": int(ratios.size)}


def _host_timer(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cuda_timer(fn: Callable[[], object]) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3
