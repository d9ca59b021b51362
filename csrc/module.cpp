// pullback_ext._C: registers the ops with the dispatcher (torch.ops.pullback_ext.*) and exposes
// the same front ends, plus build flags, as a pybind11 module.
//
// The fake (meta) kernels and the autograd formulas are registered from Python in
// pullback_ext/ops.py, which set_python_module points the dispatcher to.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>

#include "cpu/simd.h"
#include "ops/checks.h"
#include "ops/ops.h"

namespace pullback {
namespace ops {

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

}  // namespace ops
}  // namespace pullback

TORCH_LIBRARY(pullback_ext, m) {
  m.set_python_module("pullback_ext.ops");
  m.def("lowrank_metric_apply(Tensor U, Tensor lam, Tensor v, float eps, bool check_finite=False) -> Tensor");
  m.def("lowrank_metric_quadform(Tensor U, Tensor lam, Tensor v, float eps, bool check_finite=False) -> Tensor");
  m.def("token_importance(Tensor U, Tensor lam, int num_tokens, bool check_finite=False) -> Tensor");
  m.def("block_orthonormalize(Tensor X, bool check_finite=False) -> (Tensor, Tensor)");
  m.def("gather_tokens(Tensor x, Tensor idx, bool check_finite=False) -> Tensor");
  m.def("merge_tokens(Tensor x, Tensor w, Tensor src_idx, Tensor dst_idx, bool check_finite=False) -> (Tensor, Tensor)");
  m.def("reinsert_tokens(Tensor kept, Tensor kept_idx, Tensor pruned, Tensor pruned_idx, bool check_finite=False) -> Tensor");
}

// The front ends are device-generic (they dispatch on the input's device themselves), so the same
// functions serve as the CPU and the CUDA kernels.
#define PULLBACK_IMPLS(m)                                                       \
  m.impl("lowrank_metric_apply", &pullback::ops::lowrank_metric_apply);       \
  m.impl("lowrank_metric_quadform", &pullback::ops::lowrank_metric_quadform); \
  m.impl("token_importance", &pullback::ops::token_importance);               \
  m.impl("block_orthonormalize", &pullback::ops::block_orthonormalize);       \
  m.impl("gather_tokens", &pullback::ops::gather_tokens);                     \
  m.impl("merge_tokens", &pullback::ops::merge_tokens);                       \
  m.impl("reinsert_tokens", &pullback::ops::reinsert_tokens);

TORCH_LIBRARY_IMPL(pullback_ext, CPU, m) { PULLBACK_IMPLS(m) }
#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(pullback_ext, CUDA, m) { PULLBACK_IMPLS(m) }
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace pullback::ops;
  m.doc() = "Compiled kernels of pullback_ext (validated front ends; no autograd: use pullback_ext.ops).";
  m.def("lowrank_metric_apply", &lowrank_metric_apply, py::arg("U"), py::arg("lam"), py::arg("v"),
        py::arg("eps"), py::arg("check_finite") = false);
  m.def("lowrank_metric_quadform", &lowrank_metric_quadform, py::arg("U"), py::arg("lam"), py::arg("v"),
        py::arg("eps"), py::arg("check_finite") = false);
  m.def("token_importance", &token_importance, py::arg("U"), py::arg("lam"), py::arg("num_tokens"),
        py::arg("check_finite") = false);
  m.def("block_orthonormalize", &block_orthonormalize, py::arg("X"), py::arg("check_finite") = false);
  m.def("gather_tokens", &gather_tokens, py::arg("x"), py::arg("idx"), py::arg("check_finite") = false);
  m.def("merge_tokens", &merge_tokens, py::arg("x"), py::arg("w"), py::arg("src_idx"), py::arg("dst_idx"),
        py::arg("check_finite") = false);
  m.def("reinsert_tokens", &reinsert_tokens, py::arg("kept"), py::arg("kept_idx"), py::arg("pruned"),
        py::arg("pruned_idx"), py::arg("check_finite") = false);
  m.def("cuda_available", &cuda_built, "Whether the CUDA kernels were compiled into this build.");
  m.def("set_sync_checks", &set_sync_checks, py::arg("enabled"),
        "Switch the value checks that synchronise with a CUDA device on or off for this thread.");
  m.def("sync_checks_enabled", &sync_checks_enabled,
        "Whether this thread runs the value checks that synchronise with a CUDA device.");
  m.def("parallel_threads", &parallel_threads, py::arg("tasks"),
        "Threads that took part in an at::parallel_for over `tasks` chunks (the CPU kernels' loops).");
  m.def("cpu_isa", [] { return std::string(pullback::cpu::isa_name(pullback::cpu::active_isa())); },
        "Instruction set of the CPU row kernels chosen for this machine (baseline, avx2, avx512).");
}
