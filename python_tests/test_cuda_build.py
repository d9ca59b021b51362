"""The CUDA kernels build, and where a GPU is present they agree with the pure-torch reference.

Without a GPU the CUDA sources must still compile: when the installed extension was built with
its CUDA kernels (CI's bootstrap sets FORCE_CUDA=1 whenever nvcc is found: PULLBACK_CUDA_COMPILE_CHECK=1
in .ci/run), that build is the proof; when it
was not, every ``csrc/cuda/*.cu`` is compiled here with ``nvcc -c``, so a CUDA compile error fails
the suite either way. Everything skips cleanly on a machine without nvcc.

The GPU tests aim at the kernels' own code paths (chunked reductions with several tile groups,
the matrix outside shared memory, unaligned token blocks, scalar and vector row copies, long
merge lists); the op tests proper run on every device elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import pullback_ext

ROOT = Path(__file__).resolve().parents[1]
CUDA_SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))


def _find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [Path(cuda_home) / "bin" / "nvcc"] if cuda_home else []
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("nvcc")


NVCC = _find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME)")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _built_with_cuda() -> bool:
    return bool(pullback_ext.build_info().get("with_cuda"))


@needs_nvcc
@pytest.mark.skipif(torch.version.cuda is None, reason="CPU-only torch: the extension cannot link CUDA")
def test_extension_was_built_with_cuda():
    info = pullback_ext.build_info()
    assert info.get("compiled"), (
        "nvcc and a CUDA build of torch are installed but pullback_ext was not compiled; "
        "build with `FORCE_CUDA=1 pip install --no-build-isolation -e .`"
    )
    assert info["with_cuda"], (
        f"pullback_ext was compiled without its CUDA kernels although nvcc ({NVCC}) and torch "
        f"{torch.__version__} are present: rebuild with FORCE_CUDA=1 (build info: {info})"
    )
    assert info["cuda_archs"], f"a CUDA build must record its archs, got {info}"
    from pullback_ext._loader import load_compiled

    compiled = load_compiled()
    assert compiled is not None and compiled.cuda_available(), "the loaded _C module lacks the CUDA kernels"


def _nvcc_command(source: Path, output: Path) -> list[str]:
    from torch.utils import cpp_extension

    includes = [str(ROOT / "csrc"), *cpp_extension.include_paths(device_type="cuda"),
                sysconfig.get_paths()["include"]]
    cuda_root = Path(NVCC).resolve().parents[1]
    includes.append(str(cuda_root / "include"))
    nvidia = Path(torch.__file__).resolve().parents[1] / "nvidia"
    includes += [str(p) for p in sorted(nvidia.glob("*/include"))]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        NVCC, "-c", str(source), "-o", str(output),
        *[f"-I{path}" for path in includes],
        "-DWITH_CUDA", "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *cpp_extension.COMMON_NVCC_FLAGS,
        "-gencode=arch=compute_90,code=sm_90", "-std=c++20", "-O1",
        "--compiler-options", "-fPIC",
    ]


@needs_nvcc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=[s.name for s in CUDA_SOURCES])
def test_cuda_source_compiles(source: Path, tmp_path: Path):
    if _built_with_cuda():
        pytest.skip("the installed extension was built with these CUDA sources")
    result = subprocess.run(_nvcc_command(source, tmp_path / (source.stem + ".o")),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"nvcc failed on {source.name}:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / (source.stem + ".o")).stat().st_size > 0


def test_there_are_cuda_sources():
    assert {s.name for s in CUDA_SOURCES} >= {"lowrank_metric.cu", "orthonormalize.cu", "tokens.cu"}


# --- on a GPU: the compiled kernels against the float64 reference on the CPU --------------------

GPU_DTYPES = [(torch.float32, 2e-5), (torch.float64, 1e-11), (torch.float16, 3e-3), (torch.bfloat16, 2e-2)]


def _ops_and_reference():
    if not _built_with_cuda():
        pytest.skip("the extension was built without its CUDA kernels")
    from pullback_ext import ops, reference

    return ops, reference


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    actual = actual.double().cpu()
    scale = expected.abs().max().clamp_min(1e-30)
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    err = (actual - expected).abs().max() / scale
    assert err <= rtol, f"max error {err:.3g} relative to {scale:.3g} exceeds {rtol}"


def _metric_inputs(B, N, D, r, k, dtype, offset=0, seed=0):
    """U[B,P,r], lam[B,r], v[B,P,k] on the GPU; `offset` elements shift U off 16-byte alignment."""
    g = torch.Generator().manual_seed(seed)
    P = N * D
    flat = torch.randn(B * P * r + offset, generator=g, dtype=torch.float64)
    U = flat[offset:].view(B, P, r)
    lam = torch.rand(B, r, generator=g, dtype=torch.float64) + 0.1
    v = torch.randn(B, P, k, generator=g, dtype=torch.float64) / P**0.5  # keeps vᵀgv in fp16 range
    flat_dev = flat.to(dtype).cuda()
    U_dev = flat_dev[offset:].view(B, P, r)
    return (U_dev, lam.to(dtype).cuda(), v.to(dtype).cuda()), (
        flat.to(dtype).double()[offset:].view(B, P, r), lam.to(dtype).double(), v.to(dtype).double())


# (B, N, D, r, k): odd sizes, r = 1, k = 1, several chunk tile groups (r*k > 4096 tiles of 4x4),
# the matrix of the product outside shared memory (r*k*4 bytes > 32 KiB), ViT-B-like rows.
# With k = 1 the single-column kernels read rows of U in 16-, 8- or 4-byte vectors, whichever
# divides the row length and the base address (offset 1 misaligns it): r = 2, 8, 24 give each
# width for some dtype; r = 1100 has too many vectors per row and takes the general kernel.
# The k = 1 quadform sums the chunks in one block per image: many chunks per thread group
# (B = 5, P = 24672), one group (r + 1 = 256) and more outputs than threads (r = 300).
METRIC_SHAPES = [
    (1, 3, 5, 1, 1),
    (2, 7, 9, 3, 2),
    (3, 17, 33, 20, 20),
    (1, 257, 24, 20, 1),
    (2, 11, 40, 70, 130),
    (1, 5, 64, 130, 80),
    (1, 33, 7, 2, 1),
    (2, 37, 16, 8, 1),
    (3, 9, 40, 24, 1),
    (1, 3, 400, 1100, 1),
    (5, 257, 96, 20, 1),
    (2, 5, 64, 255, 1),
    (1, 3, 120, 300, 1),
]


@needs_gpu
@pytest.mark.parametrize("dtype,rtol", GPU_DTYPES, ids=lambda x: str(x))
@pytest.mark.parametrize("shape", METRIC_SHAPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1])
def test_gpu_metric_ops_match_reference(shape, dtype, rtol, offset):
    ops, reference = _ops_and_reference()
    B, N, D, r, k = shape
    (U, lam, v), (U64, lam64, v64) = _metric_inputs(B, N, D, r, k, dtype, offset)
    eps = 0.25
    _close(ops.lowrank_metric_apply(U, lam, v, eps), reference.lowrank_metric_apply(U64, lam64, v64, eps), rtol)
    _close(ops.lowrank_metric_quadform(U, lam, v, eps),
           reference.lowrank_metric_quadform(U64, lam64, v64, eps), rtol)
    _close(ops.token_importance(U, lam, N), reference.token_importance(U64, lam64, N), rtol)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1000, 1), (3, 4097, 20), (2, 300, 70), (1, 20000, 64)], ids=str)
def test_gpu_block_orthonormalize(shape, dtype):
    ops, reference = _ops_and_reference()
    g = torch.Generator().manual_seed(1)
    X = torch.randn(*shape, generator=g, dtype=torch.float64)
    X[:, :, 0] *= 1e3
    Q, R = ops.block_orthonormalize(X.to(dtype).cuda(), return_r=True)
    Q64, R64 = Q.double().cpu(), R.double().cpu()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    eye = torch.eye(shape[2], dtype=torch.float64)
    assert (Q64.transpose(1, 2) @ Q64 - eye).abs().max() <= tol
    recon = (Q64 @ R64 - X.to(dtype).double()).abs().max() / X.abs().max()
    assert recon <= 50 * tol


def _index_sets(B, N, R, seed):
    """Per image: R distinct sources and, for each, a kept destination (several share one)."""
    g = torch.Generator().manual_seed(seed)
    src, dst = [], []
    for _ in range(B):
        perm = torch.randperm(N, generator=g)
        kept = perm[R:]
        src.append(perm[:R])
        dst.append(kept[torch.randint(0, max(1, min(3, kept.numel())), (R,), generator=g)])
    return torch.stack(src), torch.stack(dst)


@needs_gpu
@pytest.mark.parametrize("dtype,rtol", GPU_DTYPES, ids=lambda x: str(x))
@pytest.mark.parametrize("B,N,D,R", [(1, 5, 3, 2), (2, 257, 768, 64), (3, 600, 7, 590), (2, 9, 8, 0)], ids=str)
def test_gpu_token_ops_match_reference(B, N, D, R, dtype, rtol):
    ops, reference = _ops_and_reference()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, N, D, generator=g, dtype=torch.float64).to(dtype)
    w = torch.rand(B, N, generator=g, dtype=torch.float64).to(dtype)
    w[:, 0] = 0  # a zero weight exercises the unchanged-features rule
    src, dst = _index_sets(B, N, R, seed=3)
    x64, w64 = x.double(), w.double()

    xm, wm = ops.merge_tokens(x.cuda(), w.cuda(), src.cuda(), dst.cuda())
    xr, wr = reference.merge_tokens(x64, w64, src, dst)
    _close(xm, xr, rtol)
    _close(wm, wr, rtol)

    order = torch.argsort(torch.rand(B, N, generator=g), dim=1)
    K = N - R
    kept_idx, pruned_idx = order[:, :K], order[:, K:]
    gathered = ops.gather_tokens(x.cuda(), kept_idx.cuda())
    assert torch.equal(gathered.cpu(), reference.gather_tokens(x, kept_idx))
    pruned = reference.gather_tokens(x, pruned_idx)
    back = ops.reinsert_tokens(gathered, kept_idx.cuda(), pruned.cuda(), pruned_idx.cuda())
    assert torch.equal(back.cpu(), x)


@needs_gpu
def test_gpu_merge_is_deterministic():
    ops, reference = _ops_and_reference()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 257, 768, generator=g).cuda()
    w = torch.rand(4, 257, generator=g).cuda()
    src = torch.stack([torch.randperm(256, generator=g)[:128] + 1 for _ in range(4)])
    dst = torch.zeros_like(src)  # every source into token 0: one long list per image
    first = ops.merge_tokens(x, w, src.cuda(), dst.cuda())
    second = ops.merge_tokens(x, w, src.cuda(), dst.cuda())
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


# Each case raises, from pullback_ext.ops's validation or from the compiled kernels' invariant
# checks (a direct torch.ops call, whose C++ message formats numbers); run in a child process so
# that a crash in the error path (seen on a machine whose compiler linked libstdc++ statically into
# _C, see test_extension_keeps_a_static_libstdcxx_private) fails this test with the case named
# instead of ending the whole test run.
_RAISING_CASES = r"""
import sys, torch
from pullback_ext import ops
dev = sys.argv[1]
x = torch.randn(2, 5, 3, device=dev)
w = torch.rand(2, 5, device=dev)
t = lambda v: torch.tensor(v, device=dev)
cases = {
    "gather range": (IndexError, r"idx\[1, 0\] = 5 is out of range",
                     lambda: ops.gather_tokens(x, t([[0, 1], [5, 2]]))),
    "gather shape": (ValueError, r"idx must have shape",
                     lambda: ops.gather_tokens(x, t([[0, 1]]))),
    "merge repeat": (ValueError, r"src_idx must not repeat a token",
                     lambda: ops.merge_tokens(x, w, t([[0, 0], [1, 2]]), t([[3, 3], [4, 4]]))),
    "reinsert cover": (ValueError, r"must together cover 0..4 exactly once",
                       lambda: ops.reinsert_tokens(x[:, :3], t([[0, 1, 2], [0, 1, 2]]), x[:, 3:],
                                                   t([[3, 3], [3, 4]]))),
    "lam negative": (ValueError, r"lam must be >= 0 everywhere",
                     lambda: ops.token_importance(torch.randn(1, 20, 3, device=dev),
                                                  -torch.ones(1, 3, device=dev), 4)),
    "kernel invariant": (RuntimeError, r"merge_tokens: internal invariant violated: w is \[2, 4\]",
                         lambda: torch.ops.pullback_ext.merge_tokens(x, w[:, :4], t([[0], [1]]), t([[3], [4]]))),
    "kernel divisor": (RuntimeError, r"num_tokens = 7 does not divide P = 20",
                       lambda: torch.ops.pullback_ext.token_importance(torch.randn(1, 20, 3, device=dev),
                                                                       torch.ones(1, 3, device=dev), 7)),
}
import re
for name, (kind, pattern, call) in cases.items():
    print("case", name, flush=True)
    try:
        call()
    except kind as e:
        assert re.search(pattern, str(e)), (name, str(e))
    else:
        raise AssertionError(name + ": no exception")
print("all raised")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("nm") is None,
                    reason="needs Linux and binutils' nm")
def test_extension_keeps_a_static_libstdcxx_private():
    """Toolchains whose lib dir holds only libstdc++.a link it into _C. Exported, its symbols mix
    with torch's shared libstdc++ and the first error message that formats a number segfaults
    (seen on a CUDA machine whose compiler wrapper did this); setup.py links with --exclude-libs."""
    from pullback_ext._loader import load_compiled

    lib = load_compiled()
    if lib is None:
        pytest.skip("the compiled extension is not built")
    exported = subprocess.run(["nm", "-D", "--defined-only", lib.__file__], capture_output=True,
                              text=True, check=True).stdout.split()
    leaked = {"_ZNSt6locale7classicEv", "_ZNSo9_M_insertIlEERSoT_"} & set(exported)
    assert not leaked, f"{lib.__file__} exports libstdc++'s own symbols {sorted(leaked)}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_checks_raise_from_validation_and_kernels(device):
    if device == "cuda":
        _ops_and_reference()
    result = subprocess.run([sys.executable, "-c", _RAISING_CASES, device], capture_output=True,
                            text=True, timeout=300, cwd=ROOT)
    last_case = [line for line in result.stdout.splitlines() if line.startswith("case ")][-1:]
    assert result.returncode == 0 and "all raised" in result.stdout, (
        f"exit {result.returncode} at {last_case}:\n{result.stdout}\n{result.stderr[-3000:]}")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_unchecked_calls_match_and_stay_memory_safe(dtype):
    """check_values=False calls never synchronise with the device, give the checked results on valid
    inputs, and run invalid ones (out-of-range, repeated, negative) without an out-of-bounds access:
    the CUDA context stays usable and a gathered row with a bad index is NaN."""
    ops, _ = _ops_and_reference()
    g = torch.Generator().manual_seed(5)
    B, N, D, R = 3, 40, 24, 12
    x = torch.randn(B, N, D, generator=g).to(dtype).cuda()
    w = torch.rand(B, N, generator=g).to(dtype).cuda()
    src, dst = (t.cuda() for t in _index_sets(B, N, R, seed=6))
    order = torch.argsort(torch.rand(B, N, generator=g), dim=1).cuda()
    kept_idx, pruned_idx = order[:, : N - R], order[:, N - R:]
    (U, lam, v), _ = _metric_inputs(2, 7, 8, 4, 1, dtype)

    def run_all(src, dst, kept_idx, pruned_idx, lam, check_values):
        checks = dict(check_values=check_values)
        return (ops.gather_tokens(x, kept_idx, **checks), *ops.merge_tokens(x, w, src, dst, **checks),
                ops.reinsert_tokens(x[:, : N - R], kept_idx, x[:, N - R:], pruned_idx, **checks),
                ops.lowrank_metric_apply(U, lam, v, 0.3, **checks), ops.token_importance(U, lam, 7, **checks))

    checked = run_all(src, dst, kept_idx, pruned_idx, lam, True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host synchronisation raises
    try:
        unchecked = run_all(src, dst, kept_idx, pruned_idx, lam, False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(checked, unchecked):
        assert torch.equal(a, b)

    bad_kept = kept_idx.clone()
    bad_kept[0, 0], bad_kept[1, 3] = N + 7, -3
    bad_src, bad_dst = src.clone(), dst.clone()
    bad_src[0, 1] = bad_src[0, 0]        # repeated source
    bad_src[1, 0] = 10**9                # out of range
    bad_dst[2, 0] = bad_src[2, 1]        # destination merged away
    bad_dst[2, 2] = -1
    bad_pruned = pruned_idx.clone()
    bad_pruned[0, 0] = 10**6
    out = run_all(bad_src, bad_dst, bad_kept, bad_pruned, -lam, False)
    torch.cuda.synchronize()
    gathered = out[0].float()
    assert torch.isnan(gathered[0, 0]).all() and torch.isnan(gathered[1, 3]).all()
    assert torch.equal(gathered[2], checked[0][2].float())
    assert out[1].shape == (B, N - R, D) and out[3].shape == (B, N, D)
    # the context is intact: a fresh checked call still matches the reference
    assert torch.equal(ops.gather_tokens(x, kept_idx), checked[0])
