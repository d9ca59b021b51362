#!/usr/bin/env bash
# One-shot check on a CUDA machine, in under 10 minutes: builds the extension with its CUDA
# kernels for the local GPU's arch, runs the CUDA tests (ops, compiled patched forward, CUDA
# graphs, sync-debug mode), then the op benchmark on the GPU (without the torch.compile column;
# then profiled, each call split into its kernels and launch gaps), then the end-to-end pruning
# benchmark's batch-1 latency cells (bench_prune.py --device cuda --preset latency: ViT-S/16 and
# ViT-B/16 at 224 px, batch 1, bf16, eager with aten ops, kernels and launches per forward and
# where the time goes; ViT-S also under torch.compile(mode="reduce-overhead"), three models
# compiled). BENCH_PRUNE=headline runs the pruning benchmark's headline cells eager instead,
# BENCH_PRUNE=both runs both. BENCH_FULL=1 adds the op benchmark's torch.compile column and the
# full pruning matrix (tens of minutes: not for a 10-minute slot).
# Prints everything; exits non-zero when any step failed (later steps still run).
#
#   bash benchmarks/gpu_check.sh            # uses .venv/bin/python when present
#   PYTHON=python3 BENCH_OUT=/tmp/bench.json bash benchmarks/gpu_check.sh
# Step limits: 240 s build, 2 x 60 s error path, 150 s tests, 60 s + 90 s op benchmarks, 240 s
# latency cells (150 s headline cells); a run in which nothing crashes takes about 8 minutes
# (the latency cells about 3, most of it compiling three ViT-S/16 models).
# The profiled and compiled-reference benchmarks write BENCH_OUT with ".kernels" / ".compile" before
# its extension.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== ${name} ($(date +%T), limit ${limit}s): $*"
  local start=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "=== ${name}: exit ${rc} after $((SECONDS - start))s"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv || status=1
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name())" || exit 1
arch=$("$PYTHON" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
export FORCE_CUDA=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

if ! step build 240 "$PYTHON" setup.py --quiet build_ext --inplace; then
  echo "=== build failed: nothing else to run"
  exit 1
fi
"$PYTHON" -c "import pullback_ext; print('build_info', pullback_ext.build_info())"
mkdir -p out

# The error path first, in a child process per device: when raising an argument error
# crashes, print a native backtrace of the crash (cuda-gdb or gdb, when either is installed).
"$PYTHON" -c "import sys; sys.path.insert(0, 'python_tests'); import test_cuda_build as t
open('out/raising_cases.py', 'w').write(t._RAISING_CASES)" || status=1
for dev in cpu cuda; do
  if ! step "error path on ${dev}" 60 "$PYTHON" out/raising_cases.py "$dev"; then
    debugger=$(command -v cuda-gdb || command -v gdb || true)
    if [ -n "$debugger" ]; then
      timeout 180 "$debugger" -batch -ex run -ex bt -ex "info sharedlibrary" \
        --args "$(command -v "$PYTHON")" out/raising_cases.py "$dev" >"out/crash_${dev}.txt" 2>&1
      grep -A60 "received signal" "out/crash_${dev}.txt" | grep -v "^\[New Thread\|^\[Thread"
      grep -E "gomp|stdc\+\+|gcc_s|libc10|libtorch_python|_C\." "out/crash_${dev}.txt"
    fi
  fi
done

tests=(python_tests/test_cuda_build.py python_tests/test_compile_patched.py python_tests/test_bench_prune_rows.py
       python_tests/test_agglomerate_op.py)
for f in python_tests/test_ops*.py; do [ -e "$f" ] && tests+=("$f"); done
step "CUDA kernel tests" 150 "$PYTHON" -m pytest "${tests[@]}" -q --maxfail=10 -k "cuda or gpu" -p no:cacheprovider
bench_out=${BENCH_OUT:-out/bench_ops_cuda.json}
step "CUDA op benchmark" 60 "$PYTHON" benchmarks/bench_ops.py --device cuda --no-compile --out "$bench_out"
step "CUDA kernel breakdown" 90 "$PYTHON" benchmarks/bench_ops.py --device cuda --no-compile --kernels --repeats 20 \
  --out "${bench_out%.*}.kernels.${bench_out##*.}"
prune=${BENCH_PRUNE:-latency}
if [ "$prune" = latency ] || [ "$prune" = both ]; then
  step "end-to-end pruning benchmark (batch-1 latency cells)" 240 "$PYTHON" benchmarks/bench_prune.py --device cuda \
    --preset latency --repeats 5 --no-overhead --quiet --out out/bench_prune_cuda_latency.json
fi
if [ "$prune" = headline ] || [ "$prune" = both ]; then
  step "end-to-end pruning benchmark (headline cells, eager)" 150 "$PYTHON" benchmarks/bench_prune.py --device cuda \
    --compile off --quiet --out out/bench_prune_cuda.json
fi
if [ -n "${BENCH_FULL:-}" ]; then
  step "CUDA op benchmark with torch.compile" 150 "$PYTHON" benchmarks/bench_ops.py --device cuda \
    --out "${bench_out%.*}.compile.${bench_out##*.}"
  step "end-to-end pruning benchmark (full matrix)" 1800 "$PYTHON" benchmarks/bench_prune.py --device cuda --preset full \
    --quiet --repeats 3 --out out/bench_prune_cuda_full.json
fi
echo "=== gpu_check: $([ "$status" -eq 0 ] && echo PASSED || echo FAILED)"
exit "$status"
