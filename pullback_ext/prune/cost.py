"""Cost of a forward pass: theoretical FLOPs (torch's flop counter) and wall-clock time."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def count_flops(fn: Callable, *args) -> int:
    """Total FLOPs of ``fn(*args)`` as counted by ``torch.utils.flop_counter`` (no grad)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn(*args)
    return int(counter.get_total_flops())


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
