"""Timing helpers of the op benchmark: interleaved medians (wall time on the CPU, CUDA events on a
GPU) and the memory bandwidth the fused ops are measured against."""

from __future__ import annotations

import glob
import statistics
import time
from typing import Callable

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def last_level_cache_bytes(default: int = 64 * 2**20) -> int:
    """Size of the CPU's largest cache, from Linux sysfs (``default`` elsewhere)."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as fh:
                text = fh.read().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else default


def interleaved_medians_ms(fns: list[Callable[[], object]], repeats: int, device: str) -> list[float]:
    """Median wall times of several functions timed in turn, so that load from other processes
    on the machine affects all of them alike; one warm-up call each. On the CPU each call is
    preceded by a read over twice the last-level cache, so inputs come from memory, not from a
    cache the previous call left warm (the LLC of a server CPU can hold a whole B = 8 operand)."""
    flush = torch.ones(2 * last_level_cache_bytes() // 4) if device == "cpu" else None
    for fn in fns:
        fn()
    _sync(device)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times):
            if flush is not None:
                flush.sum()
            start = time.perf_counter()
            fn()
            _sync(device)
            bucket.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def cuda_interleaved_medians_ms(fns: list[Callable[[], object]], repeats: int,
                                flush_mbytes: int = 256, lead_cycles: int = 2_000_000) -> list[float]:
    """Median device times (CUDA events) of several functions timed in turn, each call preceded
    by a read over ``flush_mbytes`` of memory that evicts the L2 cache (a read, so that no dirty
    lines are left to be written back during the timed call); two warm-up calls each.

    Before each flush the stream spins for ``lead_cycles`` GPU clock cycles (about 1 ms), so that
    the host has queued the timed call before the device reaches it: the events then measure the
    device's work, not the host's time to launch it, as in a pipeline that keeps the GPU busy.
    A call that synchronises inside (the checked ops) still pays everything after its sync."""
    flush = torch.ones(flush_mbytes * 2**20 // 4, device="cuda")
    for fn in fns:
        fn()
        fn()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(repeats)] for _ in fns]
    torch.cuda.synchronize()
    for rep in range(repeats):
        for fn, pairs in zip(fns, events):
            torch.cuda._sleep(lead_cycles)
            flush.sum()
            start, end = pairs[rep]
            start.record()
            fn()
            end.record()
    torch.cuda.synchronize()
    return [statistics.median(s.elapsed_time(e) for s, e in pairs) for pairs in events]


def timed_medians_ms(fns: list[Callable[[], object]], repeats: int, device: str) -> list[float]:
    """Medians of interleaved repeats: device events on CUDA, wall time on the CPU."""
    if device == "cuda":
        return cuda_interleaved_medians_ms(fns, repeats)
    return interleaved_medians_ms(fns, repeats, device)


def read_bandwidth_gbps(device: str, repeats: int, mbytes: int = 512) -> float:
    """GB/s of a ``sum()`` over a float32 tensor far larger than the last-level cache."""
    x = torch.ones(mbytes * 2**20 // 4, device=device)
    (ms,) = timed_medians_ms([lambda: x.sum()], repeats, device)
    return x.numel() * 4 / (ms * 1e-3) / 1e9


def copy_bandwidth_gbps(device: str, repeats: int, mbytes: int = 1024) -> float:
    """GB/s of a device-to-device copy, counting the bytes read and the bytes written."""
    x = torch.ones(mbytes * 2**20 // 4, device=device)
    y = torch.empty_like(x)
    (ms,) = timed_medians_ms([lambda: y.copy_(x)], repeats, device)
    return 2 * x.numel() * 4 / (ms * 1e-3) / 1e9
