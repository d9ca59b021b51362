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
