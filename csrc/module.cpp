// pullback_ext._C: the compiled kernels and the pybind11 module that loads them.
//
// The ops are not part of this module's Python surface: each op's schema (TORCH_LIBRARY_FRAGMENT)
// and CPU kernel (TORCH_LIBRARY_IMPL(pullback_ext, CPU, ...)) live in csrc/cpu/, its CUDA kernel
// (TORCH_LIBRARY_IMPL(pullback_ext, CUDA, ...)) in csrc/cuda/, and importing this module registers
// them all as torch.ops.pullback_ext.*. Their Python surface, with argument validation, fake
// kernels and autograd, is pullback_ext/ops.py (docs/kernels.md). This module only reports how it
// was built.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <atomic>
#include <string>

#include "cpu/simd.h"

namespace {

// Threads that took part in one at::parallel_for over `tasks` single-task chunks: shows that the
// CPU kernels' loops really run in parallel in this build (it needs OpenMP when ATen uses it).
int64_t parallel_threads(int64_t tasks) {
  std::atomic<int64_t> highest{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    const int64_t mine = at::get_thread_num() + 1;
    int64_t seen = highest.load();
    while (mine > seen && !highest.compare_exchange_weak(seen, mine)) {
    }
  });
  return highest.load();
}

bool cuda_built() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "Compiled kernels of pullback_ext, registered as torch.ops.pullback_ext.* (call them "
            "through pullback_ext.ops); this module reports how they were built.";
  m.def("cuda_available", &cuda_built, "Whether the CUDA kernels were compiled into this build.");
  m.def("parallel_threads", &parallel_threads, py::arg("tasks"),
        "Threads that took part in an at::parallel_for over `tasks` chunks (the CPU kernels' loops).");
  m.def("cpu_isa", [] { return std::string(pullback::cpu::isa_name(pullback::cpu::active_isa())); },
        "Instruction set of the CPU row kernels chosen for this machine (baseline, avx2, avx512).");
}
