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
fused op with ``check_values=False``, without the value checks that synchronise with the device,
with its own share of the read bandwidth (the speed-ups are those of the default, checked call).
CUDA timings keep the device ahead of the host (see
:func:`pullback_ext.bench.timing.cuda_interleaved_medians_ms`).

Every row also times filling freshly allocated tensors of the fused op's output shapes
(``fresh_output_ms``): on the CPU a large fresh output is paid in page faults on first write by any
implementation that returns a new tensor, so it bounds the speed-up such an op can reach.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import Tensor

from pullback_ext import ops, reference
from pullback_ext._loader import load_compiled
from pullback_ext.bench.baselines import tome_merge, tome_reinsert
from pullback_ext.bench.kernel_breakdown import cuda_kernel_breakdown
from pullback_ext.bench.timing import copy_bandwidth_gbps, read_bandwidth_gbps, timed_medians_ms
from pullback_ext.errors import PullbackError

N_TOKENS, DIM, RANK = 257, 768, 20
_REFERENCES = ("lowrank_metric_apply", "lowrank_metric_quadform", "token_importance", "merge_tokens",
               "gather_tokens", "reinsert_tokens")


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


@dataclass
class Case:
    """One row to time: ``fused(check_values)`` calls the fused op, ``eager`` its eager baseline,
    ``compiled`` (optional) ``torch.compile`` of its reference; ``bytes_moved`` is the minimum the
    op must read and write; ``extra`` (optional) computes further figures of the row once."""

    op: str
    shape: str
    fused: Callable[[bool], object]
    eager: Callable[[], object]
    compiled: Callable[[], object] | None
    bytes_moved: int
    extra: Callable[[], dict] | None = None


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _metric_cases(device: str, batches: tuple, ks: tuple, compiled: dict) -> list[Case]:
    """token_importance, lowrank_metric_apply / _quadform and block_orthonormalize at every B (and k)."""
    P = N_TOKENS * DIM
    imp, apply, quad = (compiled[n] for n in ("token_importance", "lowrank_metric_apply", "lowrank_metric_quadform"))
    cases = []
    for B in batches:
        U = torch.randn(B, P, RANK, device=device)
        lam = torch.rand(B, RANK, device=device)
        cases.append(Case(
            "token_importance", f"B={B} N={N_TOKENS} D={DIM} r={RANK}",
            lambda check, U=U, lam=lam: ops.token_importance(U, lam, N_TOKENS, check_values=check),
            lambda U=U, lam=lam: reference.token_importance(U, lam, N_TOKENS),
            imp and (lambda U=U, lam=lam: imp(U, lam, N_TOKENS)), _nbytes(U, lam) + B * N_TOKENS * 4))
        for k in ks:
            v = torch.randn(B, P, k, device=device)
            shape = f"B={B} P={P} r={RANK} k={k}"
            cases.append(Case(
                "lowrank_metric_apply", shape,
                lambda check, U=U, lam=lam, v=v: ops.lowrank_metric_apply(U, lam, v, 0.1, check_values=check),
                lambda U=U, lam=lam, v=v: reference.lowrank_metric_apply(U, lam, v, 0.1),
                apply and (lambda U=U, lam=lam, v=v: apply(U, lam, v, 0.1)), _nbytes(U, v, v)))
            cases.append(Case(
                "lowrank_metric_quadform", shape,
                lambda check, U=U, lam=lam, v=v: ops.lowrank_metric_quadform(U, lam, v, 0.1, check_values=check),
                lambda U=U, lam=lam, v=v: reference.lowrank_metric_quadform(U, lam, v, 0.1),
                quad and (lambda U=U, lam=lam, v=v: quad(U, lam, v, 0.1)), _nbytes(U, v)))
        cases.append(Case(
            "block_orthonormalize", f"B={B} {P}x{RANK}",
            lambda check, X=U: ops.block_orthonormalize(X),  # it has no value checks
            lambda X=U: torch.linalg.qr(X), None, 2 * _nbytes(U),
            lambda X=U: {"orthogonality_max": _orthogonality(ops.block_orthonormalize(X))}))
    return cases


def _orthogonality(Q: Tensor) -> float:
    """max |QᵀQ - I| in float64."""
    Qd = Q.double()
    return float((Qd.mT @ Qd - torch.eye(Q.shape[-1], dtype=torch.float64, device=Q.device)).abs().max())


def _token_cases(device: str, B: int, compiled: dict, R: int = 64) -> list[Case]:
    """merge_tokens, gather_tokens and reinsert_tokens on B images of N_TOKENS tokens, R of them moved."""
    x = torch.randn(B, N_TOKENS, DIM, device=device)
    w = torch.rand(B, N_TOKENS, device=device) + 0.5
    perm = torch.argsort(torch.rand(B, N_TOKENS, device=device), dim=1)
    src, kept_idx = perm[:, :R], perm[:, R:]
    dst = kept_idx.gather(1, torch.randint(0, N_TOKENS - R, (B, R), device=device))
    kept, pruned = x[:, : N_TOKENS - R].contiguous(), x[:, N_TOKENS - R:].contiguous()
    merge, gather, reinsert = (compiled[n] for n in ("merge_tokens", "gather_tokens", "reinsert_tokens"))
    shape = f"B={B} N={N_TOKENS} D={DIM} R={R}"
    return [
        Case("merge_tokens", shape, lambda check: ops.merge_tokens(x, w, src, dst, check_values=check),
             lambda: tome_merge(x, w, src, dst), merge and (lambda: merge(x, w, src, dst)),
             _nbytes(x, w) + B * (N_TOKENS - R) * (DIM + 1) * 4),
        Case("gather_tokens", f"B={B} N={N_TOKENS} D={DIM} K={N_TOKENS - R}",
             lambda check: ops.gather_tokens(x, kept_idx, check_values=check),
             lambda: reference.gather_tokens(x, kept_idx), gather and (lambda: gather(x, kept_idx)),
             2 * B * (N_TOKENS - R) * DIM * 4),
        Case("reinsert_tokens", shape, lambda check: ops.reinsert_tokens(kept, kept_idx, pruned, src, check_values=check),
             lambda: tome_reinsert(kept, kept_idx, pruned, src),
             reinsert and (lambda: reinsert(kept, kept_idx, pruned, src)), 2 * _nbytes(x)),
    ]


def _fresh_outputs(outputs: object) -> Callable[[], object]:
    """Allocates and fills tensors shaped like ``outputs`` (a tensor or a tuple of tensors)."""
    like = outputs if isinstance(outputs, tuple) else (outputs,)
    return lambda: [torch.empty_like(t).fill_(0) for t in like]


def _time_case(case: Case, repeats: int, device: str, kernel_breakdown: bool) -> Row:
    """Times the fused call (checked, and unchecked on CUDA), its baselines and a fresh output."""
    cuda = device == "cuda"
    unchecked = (lambda: case.fused(False)) if cuda else None
    timed_fns = {"fused": lambda: case.fused(True), "eager": case.eager, "compiled": case.compiled,
                 "fresh": _fresh_outputs(case.fused(True)), "unchecked": unchecked}
    names = [k for k, f in timed_fns.items() if f is not None]
    timed = dict(zip(names, timed_medians_ms([timed_fns[k] for k in names], repeats, device)))
    kernels = cuda_kernel_breakdown(unchecked).to_dict() if kernel_breakdown else None
    return Row(case.op, case.shape, timed["fused"], timed["eager"], timed.get("compiled"), case.bytes_moved,
               case.extra() if case.extra else {}, timed.get("unchecked"), timed["fresh"], kernels)


def _row_dict(r: Row, bandwidth: float) -> dict:
    return {**asdict(r), "speedup_vs_eager": r.speedup_eager,
            "speedup_vs_compiled": (r.compiled_ms / r.fused_ms) if r.compiled_ms else None,
            "effective_gbps": r.gbps(), "share_of_read_bandwidth": r.gbps() / bandwidth,
            "unchecked_share_of_read_bandwidth": (r.bytes_moved / (r.unchecked_ms * 1e-3) / 1e9 / bandwidth
                                                  if r.unchecked_ms else None)}


def _cpu_isa() -> str | None:
    lib = load_compiled()
    return lib.cpu_isa() if lib is not None else None


def run(device: str = "cpu", quick: bool = False, repeats: int | None = None, compile_reference: bool = True,
        progress: Callable[[str], None] | None = None, kernel_breakdown: bool = False) -> dict:
    """Run every benchmark case; returns the JSON-ready result (see :func:`pullback_ext.bench.report.format_table`).

    ``kernel_breakdown`` (CUDA only) also profiles the unchecked fused call of every case and
    records its kernels and launch gaps (:mod:`pullback_ext.bench.kernel_breakdown`) in ``kernels``."""
    from pullback_ext.progress import progress_bar

    cuda = device == "cuda"
    if kernel_breakdown and not cuda:
        raise PullbackError("kernel_breakdown: needs device='cuda' (it profiles CUDA kernels)")
    repeats = repeats or (3 if quick else 50 if cuda else 15)
    torch.manual_seed(0)
    batches = (1, 4) if quick else (1, 8, 32) if cuda else (1, 8)
    compiled = {n: torch.compile(getattr(reference, n)) if compile_reference else None for n in _REFERENCES}
    cases = _metric_cases(device, batches, (1,) if quick else (1, 20), compiled)
    cases += _token_cases(device, 16 if quick else 64, compiled)

    bandwidth = read_bandwidth_gbps(device, repeats)
    rows = []
    for case in progress_bar(cases, desc="bench_ops", unit="case"):
        if progress:
            progress(f"{case.op} {case.shape}")
        rows.append(_time_case(case, repeats, device, kernel_breakdown))
    bandwidth = max(bandwidth, read_bandwidth_gbps(device, repeats))  # before and after, the better
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "compiled_ops": ops.uses_compiled(torch.empty(0, device=device)),
        "cpu_isa": _cpu_isa(),
        "quick": quick,
        "repeats": repeats,
        "read_bandwidth_gbps": bandwidth,
        "copy_bandwidth_gbps": copy_bandwidth_gbps(device, repeats) if cuda else None,
        "rows": [_row_dict(r, bandwidth) for r in rows],
    }
