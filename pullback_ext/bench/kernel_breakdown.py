"""Where the device time of one CUDA call goes: each kernel's duration and the gaps between them;
and how many kernels a call runs and launches (:func:`count_launches`).

The op benchmark times a call with CUDA events as one number. This module runs the same call
under ``torch.profiler`` and splits that number into its parts, so that a call that misses its
bandwidth target shows whether the time is in the main kernel, in a small follow-up kernel, or
between launches.

Each profiled call runs as the op benchmark times it: the stream first spins for about 1 ms (so
the host has queued the call before the device reaches it), then a read evicts the L2 cache.
A one-cycle spin kernel then marks where the call begins, and the next call's spin where it ends,
so the device activities of each call are exactly those between its marker and the next spin.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable

# Device activity categories of a torch.profiler (Kineto) chrome trace.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_SPIN = "spin_kernel"
# Host activity categories of the CUDA runtime and driver APIs, and the calls among them that launch work.
_HOST_API = ("cuda_runtime", "cuda_driver")
KERNEL_LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
                                 "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel"})
GRAPH_LAUNCH_CALLS = frozenset({"cudaGraphLaunch", "cuGraphLaunch"})


@dataclass(frozen=True)
class Activity:
    """One device activity: start and duration in microseconds."""

    name: str
    start_us: float
    duration_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


@dataclass
class Breakdown:
    """Medians over the profiled calls (microseconds).

    ``span_us``: first activity's start to last activity's end; ``busy_us``: the sum of the
    activities' durations; ``gaps_us``: span − busy (launch gaps between the call's kernels);
    ``lead_in_us``: from the end of the marker to the call's first activity (the device's
    dispatch latency, which an event-timed call also pays); ``kernels``: (name, median duration)
    in launch order; ``calls``: how many calls had that launch sequence, of ``profiled``.
    """

    span_us: float
    busy_us: float
    gaps_us: float
    lead_in_us: float
    kernels: list[tuple[str, float]]
    calls: int
    profiled: int

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = ", ".join(f"{name} {us:.1f}" for name, us in self.kernels)
        return (f"span {self.span_us:.1f} us = kernels {self.busy_us:.1f} + gaps {self.gaps_us:.1f} "
                f"(lead-in {self.lead_in_us:.1f}): {parts}")


def short_kernel_name(name: str) -> str:
    """``void ns::(anonymous namespace)::kernel<float, 16>(float const*, ...)`` -> ``kernel<float, 16>``."""
    name = re.sub(r"^void\s+", "", name.strip()).replace("(anonymous namespace)::", "")
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # the argument list is the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0 and (name[i - 1].isalnum() or name[i - 1] in "_>"):
            cut = i
            break
    name = name[:cut]
    depth, start = 0, 0
    for i in range(len(name) - 1):  # drop the namespaces outside template brackets
        if name[i] == "<":
            depth += 1
        elif name[i] == ">":
            depth -= 1
        elif name[i:i + 2] == "::" and depth == 0:
            start = i + 2
    return name[start:] or name


def device_activities(trace_events: list[dict]) -> list[Activity]:
    """The device activities of a chrome trace's ``traceEvents``, in start order."""
    found = [Activity(str(e.get("name", "")), float(e["ts"]), float(e.get("dur", 0.0)))
             for e in trace_events
             if e.get("cat") in DEVICE_CATEGORIES and e.get("ph", "X") == "X" and "ts" in e]
    return sorted(found, key=lambda a: a.start_us)


def split_calls(activities: list[Activity]) -> list[tuple[Activity, list[Activity]]]:
    """(marker, the call's activities) for each call of a profiled sequence
    [lead spin, flush, marker spin, call] × n + closing spin.

    Raises ``ValueError`` when the spins do not come in that pattern (a trace that lost events).
    """
    spins = [i for i, a in enumerate(activities) if _SPIN in a.name]
    if len(spins) < 3 or len(spins) % 2 == 0:
        raise ValueError(f"profiled trace: expected 2n + 1 spin kernels (lead and marker per call, one closing), "
                         f"found {len(spins)}")
    calls = []
    for j in range(1, len(spins) - 1, 2):
        marker, end = spins[j], spins[j + 1]
        calls.append((activities[marker], activities[marker + 1:end]))
    return calls


def summarize(calls: list[tuple[Activity, list[Activity]]]) -> Breakdown:
    """Medians over the calls that share the most common launch sequence."""
    nonempty = [(m, acts) for m, acts in calls if acts]
    if not nonempty:
        raise ValueError("profiled trace: no device activity between the markers (did the call run on the device?)")
    sequences = Counter(tuple(a.name for a in acts) for _, acts in nonempty)
    sequence, count = sequences.most_common(1)[0]
    chosen = [(m, acts) for m, acts in nonempty if tuple(a.name for a in acts) == sequence]
    spans = [acts[-1].end_us - acts[0].start_us for _, acts in chosen]
    busy = [sum(a.duration_us for a in acts) for _, acts in chosen]
    lead_in = [acts[0].start_us - m.end_us for m, acts in chosen]
    kernels = [(short_kernel_name(name), statistics.median(acts[i].duration_us for _, acts in chosen))
               for i, name in enumerate(sequence)]
    span, busy_median = statistics.median(spans), statistics.median(busy)
    return Breakdown(span, busy_median, statistics.median(s - b for s, b in zip(spans, busy)),
                     statistics.median(lead_in), kernels, count, len(calls))


def cuda_kernel_breakdown(fn: Callable[[], object], repeats: int = 20, flush_mbytes: int = 256,
                          lead_cycles: int = 2_000_000) -> Breakdown:
    """Profile ``repeats`` calls of ``fn`` on the current CUDA device (after two warm-up calls),
    each timed as :func:`pullback_ext.bench.timing.cuda_interleaved_medians_ms` times it, and
    summarize them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if repeats < 1:
        raise ValueError(f"repeats: expected a positive count, got {repeats}")
    flush = torch.ones(flush_mbytes * 2**20 // 4, device="cuda")
    fn()
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            torch.cuda._sleep(lead_cycles)
            flush.sum()
            torch.cuda._sleep(1)
            fn()
        torch.cuda._sleep(1)
        torch.cuda.synchronize()
    return summarize(split_calls(device_activities(trace_events(prof))))


def trace_events(prof) -> list[dict]:
    """The ``traceEvents`` of a finished ``torch.profiler.profile``'s chrome trace."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def count_launches(events: list[dict], calls: int = 1) -> dict:
    """Per call (of ``calls`` profiled ones): ``kernels``, the CUDA kernels that ran (the trace's device
    activities of category ``kernel``); ``launches``, the host's launch calls (CUDA runtime or
    driver API: a kernel launch, or one replay of a CUDA graph, which runs all its kernels);
    ``graph_launches``, those of them that replay a graph. What a launch-bound forward pays is the
    launches: a forward captured in a CUDA graph runs as many kernels with one launch."""
    if calls < 1:
        raise ValueError(f"calls: expected a positive count, got {calls}")
    kernels = sum(1 for e in events if e.get("cat") == "kernel" and e.get("ph", "X") == "X")
    host = [str(e.get("name", "")) for e in events if e.get("cat") in _HOST_API and e.get("ph", "X") == "X"]
    graphs = sum(1 for name in host if name in GRAPH_LAUNCH_CALLS)
    launches = graphs + sum(1 for name in host if name in KERNEL_LAUNCH_CALLS)
    return {"kernels": kernels / calls, "launches": launches / calls, "graph_launches": graphs / calls}
