"""Microbenchmarks of the fused ops against eager torch and torch.compile of the same reference.

Paper shapes: ViT-B/14 at 224 px, N = 257 tokens, D = 768 channels, r = 20, B ∈ {1, 8},
k ∈ {1, 20}; token ops at B = 64, R = 64. Every row reports medians over repeats of the fused op,
its eager reference and ``torch.compile`` of that reference, all in the same run, plus the fused
op's effective bandwidth (minimum bytes it must move / time) as a share of the read bandwidth
measured in the same run (a large ``tensor.sum()``).

The eager baselines are the pure-torch references of :mod:`pullback_ext.reference`, except:
``block_orthonormalize`` against ``torch.linalg.qr`` in the input's dtype, and merge/reinsert
against ToMe-style code (gather + scatter_reduce / scatter), as the targets are stated. The
candidates of a row are timed in turn, repeat by repeat, so that load from other processes biases
none of them.

On CUDA every call is timed with device events after the L2 cache was flushed (so B = 1, whose
U fits in the 50-60 MB L2 of recent GPUs, is read from device memory like the others), the repeats
default to 50, B = 32 is added to show the bandwidth-bound regime, and the device-to-device copy
bandwidth (bytes read + written) is reported beside the read bandwidth. A CUDA row also times the
fused op under ``ops.sync_checks(False)``, without the value checks that synchronise with the
device, with its own share of the read bandwidth (the speed-ups are those of the default, checked
call). CUDA timings keep the device ahead of the host (see ``cuda_interleaved_medians_ms``).

Every row also times filling freshly allocated tensors of the fused op's output shapes
(``fresh_output_ms``): on the CPU a large fresh output is paid in page faults on first write by any
implementation that returns a new tensor, so it bounds the speed-up such an op can reach.
"""

from __future__ import annotations

import glob
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import Tensor

from pullback_ext import ops, reference
from pullback_ext.fileio import atomic_write_json
from pullback_ext.kernel_breakdown import Breakdown, cuda_kernel_breakdown
from pullback_ext.plots import save_figure

N_TOKENS, DIM, RANK = 257, 768, 20


@dataclass
class Row:
    op: str
    shape: str
    fused_ms: float
    eager_ms: float
    compiled_ms: float | None
    bytes_moved: int
    extra: dict = field(default_factory=dict)
    unchecked_ms: float | None = None
    fresh_output_ms: float | None = None
    kernels: dict | None = None

    @property
    def speedup_eager(self) -> float:
        return self.eager_ms / self.fused_ms

    def gbps(self) -> float:
        return self.bytes_moved / (self.fused_ms * 1e-3) / 1e9


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


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def tome_merge(x: Tensor, w: Tensor, src_idx: Tensor, dst_idx: Tensor) -> tuple[Tensor, Tensor]:
    """Eager ToMe-style weighted merge (gather + scatter_reduce), same result as merge_tokens."""
    B, N, D = x.shape
    R = src_idx.shape[1]
    xw = x * w.unsqueeze(-1)
    expand_src = src_idx.unsqueeze(-1).expand(-1, -1, D)
    expand_dst = dst_idx.unsqueeze(-1).expand(-1, -1, D)
    xw = xw.scatter_reduce(1, expand_dst, xw.gather(1, expand_src), reduce="sum")
    wsum = w.scatter_reduce(1, dst_idx, w.gather(1, src_idx), reduce="sum")
    keep = torch.ones(B, N, dtype=torch.bool, device=x.device).scatter(1, src_idx, False)
    kept = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, : N - R]
    wk = wsum.gather(1, kept)
    xk = xw.gather(1, kept.unsqueeze(-1).expand(-1, -1, D)) / wk.unsqueeze(-1)
    return xk, wk


def tome_reinsert(kept: Tensor, kept_idx: Tensor, pruned: Tensor, pruned_idx: Tensor) -> Tensor:
    """Eager scatter-based reinsertion of kept and pruned tokens."""
    B, K, D = kept.shape
    out = kept.new_empty(B, K + pruned.shape[1], D)
    out.scatter_(1, kept_idx.unsqueeze(-1).expand(-1, -1, D), kept)
    out.scatter_(1, pruned_idx.unsqueeze(-1).expand(-1, -1, D), pruned)
    return out


def _compiled(fn: Callable, enabled: bool) -> Callable | None:
    return torch.compile(fn) if enabled else None


def run(device: str = "cpu", quick: bool = False, repeats: int | None = None, compile_reference: bool = True,
        progress: Callable[[str], None] | None = None, kernel_breakdown: bool = False) -> dict:
    """Run every benchmark case; returns the JSON-ready result (see ``format_table``).

    ``kernel_breakdown`` (CUDA only) also profiles the unchecked fused call of every case and
    records its kernels and launch gaps (:mod:`pullback_ext.kernel_breakdown`) in ``kernels``."""
    from tqdm import tqdm

    cuda = device == "cuda"
    if kernel_breakdown and not cuda:
        raise ValueError("kernel_breakdown: needs device='cuda' (it profiles CUDA kernels)")
    repeats = repeats or (3 if quick else 50 if cuda else 15)
    torch.manual_seed(0)
    dtype = torch.float32
    P = N_TOKENS * DIM
    batches = ((1, 8, 32) if cuda else (1, 8)) if not quick else (1, 4)
    ks = (1, 20) if not quick else (1,)
    token_batch = 64 if not quick else 16
    cases: list[tuple[str, str, Callable, Callable, Callable | None, int, Callable | None]] = []

    compiled_apply = _compiled(reference.lowrank_metric_apply, compile_reference)
    compiled_quad = _compiled(reference.lowrank_metric_quadform, compile_reference)
    compiled_imp = _compiled(reference.token_importance, compile_reference)
    compiled_merge = _compiled(reference.merge_tokens, compile_reference)
    compiled_gather = _compiled(reference.gather_tokens, compile_reference)
    compiled_reinsert = _compiled(reference.reinsert_tokens, compile_reference)

    for B in batches:
        U = torch.randn(B, P, RANK, device=device, dtype=dtype)
        lam = torch.rand(B, RANK, device=device, dtype=dtype)
        cases.append((
            "token_importance", f"B={B} N={N_TOKENS} D={DIM} r={RANK}",
            lambda U=U, lam=lam: ops.token_importance(U, lam, N_TOKENS),
            lambda U=U, lam=lam: reference.token_importance(U, lam, N_TOKENS),
            compiled_imp and (lambda U=U, lam=lam: compiled_imp(U, lam, N_TOKENS)),
            _nbytes(U, lam) + B * N_TOKENS * 4, None,
        ))
        for k in ks:
            v = torch.randn(B, P, k, device=device, dtype=dtype)
            shape = f"B={B} P={P} r={RANK} k={k}"
            cases.append((
                "lowrank_metric_apply", shape,
                lambda U=U, lam=lam, v=v: ops.lowrank_metric_apply(U, lam, v, 0.1),
                lambda U=U, lam=lam, v=v: reference.lowrank_metric_apply(U, lam, v, 0.1),
                compiled_apply and (lambda U=U, lam=lam, v=v: compiled_apply(U, lam, v, 0.1)),
                _nbytes(U, v, v), None,
            ))
            cases.append((
                "lowrank_metric_quadform", shape,
                lambda U=U, lam=lam, v=v: ops.lowrank_metric_quadform(U, lam, v, 0.1),
                lambda U=U, lam=lam, v=v: reference.lowrank_metric_quadform(U, lam, v, 0.1),
                compiled_quad and (lambda U=U, lam=lam, v=v: compiled_quad(U, lam, v, 0.1)),
                _nbytes(U, v), None,
            ))
        X = U
        cases.append((
            "block_orthonormalize", f"B={B} {P}x{RANK}",
            lambda X=X: ops.block_orthonormalize(X),
            lambda X=X: torch.linalg.qr(X),
            None, 2 * _nbytes(X),
            lambda X=X: {"orthogonality_max": float(
                (lambda Q: (Q.double().mT @ Q.double() - torch.eye(RANK, dtype=torch.float64, device=device)).abs().max())(
                    ops.block_orthonormalize(X)))},
        ))
        del U, lam

    R = 64
    B = token_batch
    x = torch.randn(B, N_TOKENS, DIM, device=device, dtype=dtype)
    w = torch.rand(B, N_TOKENS, device=device, dtype=dtype) + 0.5
    perm = torch.argsort(torch.rand(B, N_TOKENS, device=device), dim=1)
    src, kept_idx = perm[:, :R], perm[:, R:]
    dst = kept_idx.gather(1, torch.randint(0, N_TOKENS - R, (B, R), device=device))
    shape = f"B={B} N={N_TOKENS} D={DIM} R={R}"
    cases.append((
        "merge_tokens", shape,
        lambda: ops.merge_tokens(x, w, src, dst), lambda: tome_merge(x, w, src, dst),
        compiled_merge and (lambda: compiled_merge(x, w, src, dst)),
        _nbytes(x, w) + B * (N_TOKENS - R) * (DIM + 1) * 4, None,
    ))
    cases.append((
        "gather_tokens", f"B={B} N={N_TOKENS} D={DIM} K={N_TOKENS - R}",
        lambda: ops.gather_tokens(x, kept_idx), lambda: reference.gather_tokens(x, kept_idx),
        compiled_gather and (lambda: compiled_gather(x, kept_idx)),
        2 * B * (N_TOKENS - R) * DIM * 4, None,
    ))
    kept, pruned = x[:, : N_TOKENS - R].contiguous(), x[:, N_TOKENS - R:].contiguous()
    cases.append((
        "reinsert_tokens", shape,
        lambda: ops.reinsert_tokens(kept, kept_idx, pruned, src), lambda: tome_reinsert(kept, kept_idx, pruned, src),
        compiled_reinsert and (lambda: compiled_reinsert(kept, kept_idx, pruned, src)),
        2 * _nbytes(x), None,
    ))

    bandwidth = read_bandwidth_gbps(device, repeats)
    rows = []
    for name, shape, fused, eager, compiled, nbytes, extra in tqdm(cases, desc="bench_ops", unit="case"):
        if progress:
            progress(f"{name} {shape}")
        timed_fns = {"fused": fused, "eager": eager, "compiled": compiled, "fresh": _fresh_outputs(fused()),
                     "unchecked": _unchecked(fused) if cuda else None}
        names = [k for k, f in timed_fns.items() if f is not None]
        timed = dict(zip(names, timed_medians_ms([timed_fns[k] for k in names], repeats, device)))
        kernels = cuda_kernel_breakdown(timed_fns["unchecked"]).to_dict() if kernel_breakdown else None
        row = Row(name, shape, timed["fused"], timed["eager"], timed.get("compiled"), nbytes, extra() if extra else {},
                  timed.get("unchecked"), timed["fresh"], kernels)
        rows.append(row)
    bandwidth = max(bandwidth, read_bandwidth_gbps(device, repeats))  # before and after, the better
    copy_bandwidth = copy_bandwidth_gbps(device, repeats) if cuda else None
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "compiled_ops": ops.uses_compiled(torch.empty(0, device=device)),
        "cpu_isa": _cpu_isa(),
        "quick": quick,
        "repeats": repeats,
        "read_bandwidth_gbps": bandwidth,
        "copy_bandwidth_gbps": copy_bandwidth,
        "rows": [
            {**asdict(r), "speedup_vs_eager": r.speedup_eager,
             "speedup_vs_compiled": (r.compiled_ms / r.fused_ms) if r.compiled_ms else None,
             "effective_gbps": r.gbps(), "share_of_read_bandwidth": r.gbps() / bandwidth,
             "unchecked_share_of_read_bandwidth": (r.bytes_moved / (r.unchecked_ms * 1e-3) / 1e9 / bandwidth
                                                   if r.unchecked_ms else None)}
            for r in rows
        ],
    }


def _fresh_outputs(outputs: object) -> Callable[[], object]:
    """Allocates and fills tensors shaped like ``outputs`` (a tensor or a tuple of tensors)."""
    like = outputs if isinstance(outputs, tuple) else (outputs,)
    return lambda: [torch.empty_like(t).fill_(0) for t in like]


def _unchecked(fn: Callable[[], object]) -> Callable[[], object]:
    def call():
        with ops.sync_checks(False):
            return fn()
    return call


def _cpu_isa() -> str | None:
    from pullback_ext._loader import load_compiled

    lib = load_compiled()
    return lib.cpu_isa() if lib is not None else None


def format_table(result: dict) -> str:
    """The printed table: one line per case."""
    unchecked = any(r.get("unchecked_ms") is not None for r in result["rows"])
    head = (f"{'op':<24} {'shape':<30} {'fused ms':>9} {'eager ms':>9} {'compile ms':>10} "
            f"{'x eager':>8} {'x compile':>9} {'GB/s':>7} {'% read bw':>9} {'fresh out ms':>12}"
            + (f" {'unchecked ms':>12} {'% read bw':>9}" if unchecked else ""))
    lines = [f"device {result['device']} ({result['device_name']}), {result['threads']} threads, "
             f"read bandwidth {result['read_bandwidth_gbps']:.1f} GB/s"
             + (f" (copy {result['copy_bandwidth_gbps']:.1f} GB/s)" if result.get("copy_bandwidth_gbps") else "")
             + ", kernels: "
             f"{'compiled' if result['compiled_ops'] else 'reference fallback'} (cpu isa {result['cpu_isa']})",
             head, "-" * len(head)]
    for r in result["rows"]:
        comp = f"{r['compiled_ms']:10.3f}" if r["compiled_ms"] is not None else f"{'-':>10}"
        xcomp = f"{r['speedup_vs_compiled']:9.2f}" if r["speedup_vs_compiled"] is not None else f"{'-':>9}"
        note = "".join(f" {k}={v:.2e}" for k, v in r["extra"].items())
        lines.append(f"{r['op']:<24} {r['shape']:<30} {r['fused_ms']:9.3f} {r['eager_ms']:9.3f} {comp} "
                     f"{r['speedup_vs_eager']:8.2f} {xcomp} {r['effective_gbps']:7.1f} "
                     f"{100 * r['share_of_read_bandwidth']:8.0f}% "
                     + (f"{r['fresh_output_ms']:12.3f}" if r.get("fresh_output_ms") is not None else f"{'-':>12}")
                     + (f" {r['unchecked_ms']:12.3f} {100 * r['unchecked_share_of_read_bandwidth']:8.0f}%"
                        if r.get("unchecked_ms") is not None else f" {'-':>12} {'-':>9}" if unchecked else "")
                     + note)
    profiled = [r for r in result["rows"] if r.get("kernels")]
    if profiled:
        lines += ["", "unchecked calls profiled (medians, us): span = kernels + gaps; lead-in = dispatch after the marker"]
        lines += [f"{r['op']:<24} {r['shape']:<30} {Breakdown(**r['kernels']).describe()}" for r in profiled]
    return "\n".join(lines)


def write_outputs(result: dict, path: str) -> list[str]:
    """Atomically write the JSON to ``path`` and a speed-up bar plot next to it; returns the paths."""
    atomic_write_json(path, result)
    plot_path = os.path.splitext(path)[0] + ".png"
    _plot(result, plot_path)
    return [path, plot_path]


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['op']}\n{r['shape']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [r["speedup_vs_eager"] for r in rows], height=0.4, label="vs eager")
    ax.barh([y + 0.2 for y in ys], [r["speedup_vs_compiled"] or 0 for r in rows], height=0.4, label="vs torch.compile")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(list(ys), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up of the fused op")
    ax.set_title(f"pullback_ext ops on {result['device']} ({result['threads']} threads)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
