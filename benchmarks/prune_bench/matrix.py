"""The end-to-end pruning benchmark: whole patched models against the unpruned one and ToMe.

A *cell* is one model at one image size, batch, dtype and compile mode; in each cell every method
of :func:`~prune_bench.models.method_grid` runs on the same random images, timed by
the one harness of ``pullback evaluate`` (:func:`~pullback_ext.comparison.cost.interleaved_wall_clock`:
medians of interleaved rounds, CUDA events on a GPU, wall clock on the CPU). Each row reports
images/s, the speed-up over the unpruned model of the same cell, the FLOP ratio (torch's flop
counter at batch 1, the reduced forward's scoring and matching included), speed-up ÷ FLOP ratio,
the share of the eager forward's time spent in this library's ops (``torch.profiler``: the
``pullback_ext::`` ops' time, their kernels included, over the whole forward's), and the operators
one eager forward at the cell's batch dispatches (:func:`pullback_ext.bench.dispatch.count_aten_ops`:
what a launch-bound forward pays per call, which FLOPs do not show; a compiled row repeats its
eager count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from prune_bench.models import MODELS, Method, ModelCase, find_method, matched_merge, method_grid
from pullback_ext.bench.dispatch import count_aten_ops
from pullback_ext.comparison.cost import count_flops, interleaved_wall_clock, speedup_interval
from pullback_ext.errors import PullbackError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Sweep:
    """Cells to run for one model: the cross product of ``sizes × batches × dtypes × compiled``.
    ``methods``: name prefixes of the grid's methods to keep (None: all); ``matched_r``: add our
    merge at the FLOPs of the ToMe row with this ``r`` (None: no such row)."""

    model: str
    sizes: tuple[int, ...]
    batches: tuple[int, ...]
    dtypes: tuple[str, ...]
    compiled: tuple[bool, ...] = (False,)
    methods: Optional[tuple[str, ...]] = None
    matched_r: Optional[int] = 16

    def __post_init__(self):
        if self.model not in MODELS:
            raise PullbackError(f"--models: unknown model {self.model!r}; choose from {', '.join(MODELS)}")
        unknown = [d for d in self.dtypes if d not in DTYPES]
        if unknown:
            raise PullbackError(f"--dtypes: unknown dtype {unknown[0]!r}; choose from {', '.join(DTYPES)}")
        if not (self.sizes and self.batches and self.dtypes and self.compiled):
            raise PullbackError("--sizes, --batches, --dtypes and --compile must each name at least one value")


def run_sweep(sweep: Sweep, etas: Sequence[float], tome_rs: Sequence[int], device: torch.device, repeats: int,
              progress: bool = True) -> list[dict]:
    """Every row of ``sweep`` on ``device`` (one dict per cell × method)."""
    from pullback_ext.progress import progress_bar

    case = MODELS[sweep.model]
    rows: list[dict] = []
    combos = [(s, d) for s in sweep.sizes for d in sweep.dtypes]
    for size, dtype in progress_bar(combos, desc=f"bench {case.key}", enabled=progress, unit="setting"):
        model = case.build(size).to(device=device, dtype=DTYPES[dtype])
        image = torch.rand(1, 3, size, size, device=device, dtype=DTYPES[dtype])
        patched = {m.name: m.apply(model, case) for m in _methods(case, model, sweep, etas, tome_rs, image)}
        flops = {name: count_flops(fn, image) for name, fn in patched.items()}
        for batch in sweep.batches:
            x = torch.rand(batch, 3, size, size, device=device, dtype=DTYPES[dtype])
            shares = {name: kernel_share(fn, x, device) for name, fn in patched.items()}
            dispatched = {name: count_aten_ops(fn, x) for name, fn in patched.items()}
            for compiled in sweep.compiled:
                fns = {name: (torch.compile(fn) if compiled else fn) for name, fn in patched.items()}
                times = interleaved_wall_clock({n: (lambda f=f: f(x)) for n, f in fns.items()}, repeats=repeats,
                                               warmup=2 if compiled else 1, device=device)
                cell = dict(model=case.key, title=case.title, size=size, batch=batch, dtype=dtype, compiled=compiled)
                rows += _rows(cell, times, flops, shares, dispatched)
        del patched, model
    return rows


def _methods(case: ModelCase, model, sweep: Sweep, etas, tome_rs, image) -> list[Method]:
    grid = method_grid(case, tuple(etas), tuple(tome_rs))
    target = None if sweep.matched_r is None else find_method(grid, f"ToMe r={sweep.matched_r} ")
    if target is not None:
        grid.append(matched_merge(case, model, image, target))
    if sweep.methods is None:
        return grid
    kept = [m for m in grid if m.name == "unpruned" or any(m.name.startswith(p) for p in sweep.methods)]
    if len(kept) < 2:
        raise PullbackError(f"--methods: none of {list(sweep.methods)} names a method of {case.title}; "
                            f"the methods are: {', '.join(m.name for m in grid)}")
    return kept


def _rows(cell: dict, times: dict, flops: dict, shares: dict, dispatched: dict) -> list[dict]:
    """One row per method of a cell; ``speedup``: the median over rounds of the round's unpruned /
    method time, ``speedup_ci90``: its bootstrap 90% interval (:func:`speedup_interval`),
    ``aten_ops``: the operators one eager forward dispatches."""
    base_f = flops["unpruned"]
    out = []
    for name, t in times.items():
        spread = speedup_interval(times["unpruned"]["times_s"], t["times_s"])
        speedup, flop_ratio = spread["median"], base_f / flops[name]
        out.append(dict(cell, method=name, median_s=t["median_s"], images_per_s=cell["batch"] / t["median_s"],
                        speedup=speedup, speedup_ci90=[spread["low"], spread["high"]], gflops_per_image=flops[name] / 1e9,
                        flop_ratio=flop_ratio,
                        speedup_over_flop_ratio=speedup / flop_ratio, kernel_share=shares[name], aten_ops=dispatched[name],
                        times_s=t["times_s"]))
    return out


def kernel_share(fn, x: torch.Tensor, device: torch.device) -> Optional[float]:
    """Fraction of one eager ``fn(x)``'s time spent in ``pullback_ext::`` ops (device time on CUDA,
    CPU time elsewhere); None when the forward calls none (the unpruned model, or the pure-torch
    fallback of an uncompiled checkout)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad():
        fn(x)
        with profile(activities=activities) as prof:
            fn(x)
            if cuda:
                torch.cuda.synchronize()
    events = prof.key_averages()
    self_time = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    total_time = (lambda e: e.device_time_total) if cuda else (lambda e: e.cpu_time_total)
    ours = sum(total_time(e) for e in events if e.key.startswith("pullback_ext::"))
    whole = sum(self_time(e) for e in events)
    if ours == 0 or whole == 0:
        return None
    return ours / whole
