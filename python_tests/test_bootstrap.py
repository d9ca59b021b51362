"""The bootstrap (what `make demo` and `make test` run first) rebuilds nothing when nothing changed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "bootstrap.sh"


def _run_check(env=None):
    return subprocess.run(["bash", str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
                    reason="runs inside the bootstrap's own virtual environment (make test)")
def test_bootstrap_is_up_to_date_after_setup():
    """`make test` ran the bootstrap just before this suite: a second run must have nothing to do
    (no recompilation of the extension, no package install)."""
    result = _run_check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "up to date"


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
                    reason="runs inside the bootstrap's own virtual environment (make test)")
def test_bootstrap_sees_changed_build_flags():
    """The check is not vacuous: other build flags than those of the last build make it stale."""
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST="5.0", FORCE_CUDA=os.environ.get("FORCE_CUDA", "0"))
    result = _run_check(env)
    assert result.returncode == 1
    assert "extension" in result.stdout


def _flags(**env) -> str:
    """The build flags the bootstrap chooses in this environment (``--flags``), for this interpreter's venv."""
    base = {k: v for k, v in os.environ.items() if k not in ("FORCE_CUDA", "TORCH_CUDA_ARCH_LIST", "PULLBACK_CUDA_COMPILE_CHECK")}
    result = subprocess.run(["bash", str(SCRIPT), "--flags"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**base, "PULLBACK_VENV": sys.prefix, **env})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


def _nvcc() -> bool:
    home = os.environ.get("CUDA_HOME") or ("/usr/local/cuda" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    return home is not None and os.access(Path(home) / "bin" / "nvcc", os.X_OK)


def test_the_cuda_kernels_are_built_where_a_gpu_can_run_them_or_a_compile_check_asks():
    """`make demo` / `make test` compile the CUDA kernels only where a GPU is visible (minutes of
    nvcc for nothing elsewhere); CI's compile check (PULLBACK_CUDA_COMPILE_CHECK=1, .ci/run) builds
    them wherever nvcc and a CUDA torch are found; FORCE_CUDA given by hand is kept."""
    import torch

    can_compile = _nvcc() and torch.version.cuda is not None
    default = _flags()
    assert default.startswith(f"FORCE_CUDA={int(can_compile and torch.cuda.is_available())} ")
    checked = _flags(PULLBACK_CUDA_COMPILE_CHECK="1")
    assert checked.startswith(f"FORCE_CUDA={int(can_compile)} ")
    if can_compile and not torch.cuda.is_available():
        assert checked == "FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0"  # one architecture for a compile check
    assert _flags(FORCE_CUDA="0", PULLBACK_CUDA_COMPILE_CHECK="1").startswith("FORCE_CUDA=0 ")
    assert "PULLBACK_CUDA_COMPILE_CHECK=1" in (ROOT / ".ci" / "run").read_text()
