"""Cost of a forward pass: theoretical FLOPs (torch's flop counter) and wall-clock time."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


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
    times = []
    with torch.no_grad():
        for i in range(warmup + repeats):
            start = time.perf_counter()
            fn(*args)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "repeats": repeats}
