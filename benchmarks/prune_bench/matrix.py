"""The end-to-end pruning benchmark: whole patched models against the unpruned one and ToMe.

A *cell* is one model at one image size, batch, dtype and compile mode (eager; ``torch.compile``
with inductor; on CUDA also ``mode="reduce-overhead"``, CUDA graphs); in each cell every method of
:func:`~prune_bench.models.method_grid` that the sweep keeps runs on the same random images, timed
by the one harness of ``pullback evaluate`` (:func:`~pullback_ext.comparison.cost.interleaved_wall_clock`:
medians of interleaved rounds, CUDA events on a GPU, wall clock on the CPU). Each row reports
images/s, the speed-up over the unpruned model of the same cell with its bootstrap interval, the
FLOP ratio (torch's flop counter at batch 1, the reduced forward's scoring and matching included),
speed-up ÷ FLOP ratio, and, from one profiled eager forward at the cell's batch
(:mod:`pullback_ext.bench.forward_profile`): the share of the operators' time spent in this
library's ops and where the time goes (matmuls, attention, our ops, everything else, and outside
any op); the operators one eager forward dispatches (:func:`pullback_ext.bench.dispatch.count_aten_ops`:
what a launch-bound forward pays per call, which FLOPs do not show; a compiled row repeats its
eager count) and their ratio to the unpruned forward's; on CUDA the kernels run and launched per
forward (:func:`pullback_ext.bench.kernel_breakdown.count_launches`, of the eager forward and of
each compiled one). A compiled row also gives its first two calls' seconds (compiling, when the
shape needs a graph, and two forwards; a compiled model is kept across the sweep's batches, so the
second batch compiles a graph dynamic in the batch and the third reuses it).

An eager cell at a batch of ``Sweep.onnx_batches`` also times the ToMe and importance_tome models
(and the unpruned one) exported to ONNX and run by ONNX Runtime on the CPU, in the same rounds
(:mod:`prune_bench.onnx_rows`): rows named ``ONNX Runtime: <method>``, whose speed-up is over the
eager unpruned model and ``over_eager`` their speed over the same method's eager forward.

A method that cannot be compiled or exported is left out of its cell with the reason (``skipped``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from prune_bench.models import MODELS, Method, ModelCase, find_method, matched_merge, method_grid
from prune_bench.onnx_rows import PREFIX as ONNX_PREFIX
from prune_bench.onnx_rows import onnx_runners, unavailable
from pullback_ext.bench.dispatch import count_aten_ops
from pullback_ext.bench.forward_profile import cuda_launches, forward_profile
from pullback_ext.comparison.cost import count_flops, interleaved_wall_clock, speedup_interval
from pullback_ext.errors import PullbackError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
COMPILE_MODES = (False, True, "reduce-overhead")  # eager, torch.compile (inductor), CUDA graphs
BIG_BATCH = 64  # cells from this batch on take ``big_batch_repeats`` rounds when that is set
PROFILED_CALLS = 3  # profiled forwards at batch 1 (the page's profile): the one of median wall time is kept
RECOMPILE_LIMIT = 64  # graphs per code object: every patched model compiles the same forward's code


@dataclass(frozen=True)
class Sweep:
    """Cells to run for one model: the cross product of ``sizes × batches × dtypes × compiled``.
    ``methods``: name prefixes of the grid's methods to keep (None: all), ``exclude``: substrings
    of names to drop from those; ``matched_r``: add our merge at the FLOPs of the ToMe row with this
    ``r`` (None: no such row); ``compiled_methods``: name prefixes of the methods also run in the
    compiled cells (None: all; the unpruned model always); ``onnx_batches``: batches whose eager
    cell adds the ONNX Runtime rows of the methods named by the prefixes ``onnx_methods``."""

    model: str
    sizes: tuple[int, ...]
    batches: tuple[int, ...]
    dtypes: tuple[str, ...]
    compiled: tuple = (False,)
    methods: Optional[tuple[str, ...]] = None
    matched_r: Optional[int] = 16
    exclude: tuple[str, ...] = ()
    compiled_methods: Optional[tuple[str, ...]] = None
    onnx_batches: tuple[int, ...] = ()
    onnx_methods: tuple[str, ...] = ("ToMe r=", "importance_tome r=")

    def __post_init__(self):
        if self.model not in MODELS:
            raise PullbackError(f"--models: unknown model {self.model!r}; choose from {', '.join(MODELS)}")
        unknown = [d for d in self.dtypes if d not in DTYPES]
        if unknown:
            raise PullbackError(f"--dtypes: unknown dtype {unknown[0]!r}; choose from {', '.join(DTYPES)}")
        if not (self.sizes and self.batches and self.dtypes and self.compiled):
            raise PullbackError("--sizes, --batches, --dtypes and --compile must each name at least one value")
        modes = [m for m in self.compiled if not (m is False or m is True or m == "reduce-overhead")]
        if modes:
            raise PullbackError(f"--compile: unknown compile mode {modes[0]!r}; choose from {COMPILE_MODES}")


def run_sweep(sweep: Sweep, etas: Sequence[float], tome_rs: Sequence[int], device: torch.device, repeats: int,
              progress: bool = True, big_batch_repeats: Optional[int] = None, skipped: Optional[list] = None) -> list[dict]:
    """Every row of ``sweep`` on ``device`` (one dict per cell × method). A cell of batch ≥
    ``BIG_BATCH`` takes ``min(repeats, big_batch_repeats)`` rounds when ``big_batch_repeats`` is
    given. A method that fails to compile or export is appended to ``skipped`` (its cell, method and
    reason) when a list is given, else raises."""
    from pullback_ext.progress import progress_bar

    case = MODELS[sweep.model]
    rows: list[dict] = []
    combos = [(s, d) for s in sweep.sizes for d in sweep.dtypes]
    for size, dtype in progress_bar(combos, desc=f"bench {case.key}", enabled=progress, unit="setting"):
        model = case.build(size).to(device=device, dtype=DTYPES[dtype])
        image = torch.rand(1, 3, size, size, device=device, dtype=DTYPES[dtype])
        patched = {m.name: m.apply(model, case) for m in _methods(case, model, sweep, etas, tome_rs, image)}
        flops = {name: count_flops(fn, image) for name, fn in patched.items()}
        compiled: dict = {}  # (mode, method) -> its compiled model, kept across the batches
        for batch in sweep.batches:
            x = torch.rand(batch, 3, size, size, device=device, dtype=DTYPES[dtype])
            eager = {name: eager_info(fn, x, device) for name, fn in patched.items()}
            rounds = repeats if big_batch_repeats is None or batch < BIG_BATCH else min(repeats, big_batch_repeats)
            for mode in sweep.compiled:
                cell = dict(model=case.key, title=case.title, size=size, batch=batch, dtype=dtype, compiled=mode)
                rows += _time_cell(cell, patched, flops, eager, _Run(sweep, x, device, rounds, compiled, skipped))
        del patched, model, compiled
    return rows


@dataclass
class _Run:
    """What timing one cell needs besides its models: the sweep, the input, the device, the rounds,
    the compiled models kept across batches and the list of skipped methods (None: raise)."""

    sweep: Sweep
    x: torch.Tensor
    device: torch.device
    rounds: int
    compiled: dict
    skipped: Optional[list]

    def skip(self, cell: dict, method: str, reason: str) -> None:
        if self.skipped is None:
            raise PullbackError(f"{method}: {reason}")
        self.skipped.append(dict(cell, method=method, reason=reason))


def _time_cell(cell: dict, patched: dict, flops: dict, eager: dict, run: _Run) -> list[dict]:
    """The rows of one cell: its models (compiled in a compiled cell) and, in an eager cell at an
    ONNX batch, their ONNX Runtime sessions, timed in one interleaved run."""
    if cell["compiled"] is False:
        fns, extra = dict(patched), {name: {} for name in patched}
    else:
        fns, extra = _compiled_models(cell, patched, run)
    if "unpruned" not in fns:
        return []
    timed = {name: (lambda f=f: f(run.x)) for name, f in fns.items()}
    onnx = _onnx(cell, patched, run) if cell["compiled"] is False and cell["batch"] in run.sweep.onnx_batches else None
    try:
        if onnx is not None:
            timed.update(onnx.fns)
        times = interleaved_wall_clock(timed, repeats=run.rounds, warmup=1, device=run.device)
    finally:
        if onnx is not None:
            onnx.close()
    base_ops = eager["unpruned"]["aten_ops"]
    rows = []
    for name in fns:
        info = eager[name]
        rows.append(_timing(cell, name, times, flops, name) | dict(
            runtime="torch", kernel_share=info["kernel_share"], aten_ops=info["aten_ops"],
            aten_ops_ratio=info["aten_ops"] / base_ops,
            time_split=info["split"] if cell["compiled"] is False else None,
            launches=info["launches"] if cell["compiled"] is False else extra[name].get("launches"),
            compile_s=extra[name].get("compile_s")))
    for name in [n for n in patched if onnx is not None and ONNX_PREFIX + n in times]:
        over = speedup_interval(times[name]["times_s"], times[ONNX_PREFIX + name]["times_s"])
        rows.append(_timing(cell, ONNX_PREFIX + name, times, flops, name) | dict(
            runtime="onnxruntime", eager_method=name, kernel_share=None, aten_ops=None, aten_ops_ratio=None,
            time_split=None, launches=None, compile_s=None, max_abs_diff=onnx.diffs[ONNX_PREFIX + name],
            over_eager=over["median"], over_eager_ci90=[over["low"], over["high"]]))
    return rows


def _timing(cell: dict, name: str, times: dict, flops: dict, method: str) -> dict:
    """The timing columns of row ``name`` (whose FLOPs are ``method``'s); ``speedup``: the median
    over rounds of the round's unpruned / row time, ``speedup_ci90``: its bootstrap 90% interval
    (:func:`speedup_interval`)."""
    t = times[name]
    spread = speedup_interval(times["unpruned"]["times_s"], t["times_s"])
    speedup, flop_ratio = spread["median"], flops["unpruned"] / flops[method]
    return dict(cell, method=name, median_s=t["median_s"], images_per_s=cell["batch"] / t["median_s"], speedup=speedup,
                speedup_ci90=[spread["low"], spread["high"]], gflops_per_image=flops[method] / 1e9, flop_ratio=flop_ratio,
                speedup_over_flop_ratio=speedup / flop_ratio, times_s=t["times_s"])


def compile_model(fn, mode):
    """``torch.compile`` of ``fn`` in ``mode`` (True: inductor's default; ``"reduce-overhead"``: CUDA
    graphs), with dynamo's per-code-object graph limit raised to ``RECOMPILE_LIMIT`` (the patched
    models of a cell share their forward's code, and each needs its own graphs)."""
    import torch._dynamo

    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), RECOMPILE_LIMIT))
    return torch.compile(fn) if mode is True else torch.compile(fn, mode=mode)


def _compiled_models(cell: dict, patched: dict, run: _Run) -> tuple[dict, dict]:
    """The compiled models of a cell, each called twice first (compiling, recording a CUDA graph)
    and on CUDA profiled once for its launches: ``(models, {method: {compile_s, launches}})``."""
    keep = run.sweep.compiled_methods
    fns, extra = {}, {}
    cuda = run.device.type == "cuda"
    for name in [n for n in patched if n == "unpruned" or keep is None or any(n.startswith(p) for p in keep)]:
        key = (cell["compiled"], name)
        try:
            if key not in run.compiled:
                run.compiled[key] = compile_model(patched[name], cell["compiled"])
            start = time.perf_counter()
            with torch.no_grad():
                run.compiled[key](run.x)
                run.compiled[key](run.x)
            if cuda:
                torch.cuda.synchronize(run.device)
            extra[name] = dict(compile_s=time.perf_counter() - start,
                               launches=cuda_launches(run.compiled[key], run.x) if cuda else None)
        except Exception as err:  # noqa: BLE001 - a model that does not compile leaves its row out, not the cell
            run.skip(cell, name, f"torch.compile failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            continue
        fns[name] = run.compiled[key]
    return fns, extra


def _onnx(cell: dict, patched: dict, run: _Run):
    """The ONNX Runtime sessions of the cell's ToMe, importance_tome and unpruned models (None,
    with the reason recorded, where they cannot run)."""
    reason = unavailable(run.device, run.x.dtype)
    if reason is not None:
        run.skip(cell, "ONNX Runtime rows", reason)
        return None
    names = [n for n in patched if n == "unpruned" or any(n.startswith(p) for p in run.sweep.onnx_methods)]
    runners = onnx_runners(patched, names, run.x, torch.get_num_threads())
    for name, why in runners.skipped:
        run.skip(cell, ONNX_PREFIX + name, why)
    return runners


def eager_info(fn, x: torch.Tensor, device: torch.device) -> dict:
    """What one eager ``fn(x)`` dispatches (``aten_ops``; the call also warms the profiled one up)
    and its profile: ``kernel_share``, ``split`` (:func:`~pullback_ext.bench.forward_profile.time_split`)
    and, on CUDA, ``launches``; at batch 1 of the profile of median wall time of ``PROFILED_CALLS``."""
    ops = count_aten_ops(fn, x)
    profiled = forward_profile(fn, x, cuda=device.type == "cuda", calls=PROFILED_CALLS if x.shape[0] == 1 else 1)
    return dict(aten_ops=ops, kernel_share=profiled["kernel_share"], split=profiled["split"], launches=profiled["launches"])


def _methods(case: ModelCase, model, sweep: Sweep, etas, tome_rs, image) -> list[Method]:
    grid = method_grid(case, tuple(etas), tuple(tome_rs))
    target = None if sweep.matched_r is None else find_method(grid, f"ToMe r={sweep.matched_r} ")
    if target is not None:
        grid.append(matched_merge(case, model, image, target))
    if sweep.methods is None and not sweep.exclude:
        return grid
    kept = [m for m in grid if m.name == "unpruned" or (
        (sweep.methods is None or any(m.name.startswith(p) for p in sweep.methods)) and not any(s in m.name for s in sweep.exclude))]
    if len(kept) < 2:
        raise PullbackError(f"--methods: none of {list(sweep.methods or ())} names a method of {case.title}; "
                            f"the methods are: {', '.join(m.name for m in grid)}")
    return kept


def kernel_share(fn, x: torch.Tensor, device: torch.device) -> Optional[float]:
    """Fraction of one eager ``fn(x)``'s operator time spent in ``pullback_ext::`` ops (device time
    on CUDA, CPU time elsewhere); None when the forward calls none (the unpruned model, or the
    pure-torch fallback of an uncompiled checkout)."""
    with torch.no_grad():
        fn(x)
    return forward_profile(fn, x, cuda=device.type == "cuda")["kernel_share"]
