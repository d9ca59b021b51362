#include "ops/checks.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace pullback {
namespace ops {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

void check_rank(const at::Tensor& t, const char* name, int64_t dim, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must have ", dim, " dimensions ", layout, ", got shape ",
                    shape_str(t));
}

void check_shape(const at::Tensor& t, const char* name, const std::vector<int64_t>& expected,
                 const char* layout) {
  check_rank(t, name, static_cast<int64_t>(expected.size()), layout);
  bool ok = true;
  for (size_t d = 0; d < expected.size(); ++d) ok = ok && (expected[d] < 0 || t.size(d) == expected[d]);
  if (ok) return;
  std::ostringstream want;
  want << "[";
  for (size_t d = 0; d < expected.size(); ++d) {
    if (d) want << ", ";
    if (expected[d] < 0)
      want << "*";
    else
      want << expected[d];
  }
  want << "]";
  TORCH_CHECK_VALUE(false, name, " must have shape ", layout, " = ", want.str(), ", got ", shape_str(t));
}

void check_float_input(const at::Tensor& t, const char* name) {
  const auto dt = t.scalar_type();
  if (t.is_cpu()) {
    TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kDouble, name,
                     " must be float32 or float64 on the CPU, got ", dt);
    return;
  }
#ifdef WITH_CUDA
  if (t.is_cuda()) {
    TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kDouble || dt == at::kHalf || dt == at::kBFloat16,
                     name, " must be float32, float64, float16 or bfloat16 on CUDA, got ", dt);
    return;
  }
#endif
  TORCH_CHECK_VALUE(false, name, " must be on the CPU",
#ifdef WITH_CUDA
                    " or a CUDA device",
#endif
                    ", got device ", t.device());
}

void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), name, " must have the dtype of ", ref_name,
                   " (", ref.scalar_type(), "), got ", t.scalar_type());
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " must be on the device of ", ref_name, " (",
                    ref.device(), "), got ", t.device());
}

void check_index_tensor(const at::Tensor& idx, const char* name, const at::Tensor& ref,
                        const char* ref_name, int64_t batch) {
  TORCH_CHECK_TYPE(idx.scalar_type() == at::kLong, name, " must be an int64 index tensor, got ",
                   idx.scalar_type());
  check_shape(idx, name, {batch, -1}, "[B, K]");
  check_same_device(idx, name, ref, ref_name);
}

void check_batch(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() >= 1 && t.size(0) >= 1, name,
                    " has an empty batch (B = 0, shape ", shape_str(t), "); expected B >= 1");
}

void check_tall_skinny(const at::Tensor& t, const char* name) {
  check_rank(t, name, 3, "[B, P, r]");
  check_batch(t, name);
  check_float_input(t, name);
  const int64_t P = t.size(1), r = t.size(2);
  TORCH_CHECK_VALUE(r >= 1 && r <= P, name, " must be tall with 1 <= r <= P (shape [B, P, r]), got r = ", r,
                    ", P = ", P);
}

namespace {
thread_local bool sync_checks = true;
}  // namespace

void set_sync_checks(bool enabled) { sync_checks = enabled; }

bool sync_checks_enabled() { return sync_checks; }

bool value_checks(const at::Tensor& t) { return t.is_cpu() || sync_checks; }

void check_nonnegative(const at::Tensor& t, const char* name) {
  if (t.numel() == 0 || !value_checks(t)) return;
  const double lowest = t.min().item<double>();
  TORCH_CHECK_VALUE(!(lowest < 0.0), name, " must be >= 0 everywhere, got a minimum of ", lowest);
}

void check_all_finite(const at::Tensor& t, const char* name) {
  if (t.numel() == 0) return;
  const int64_t bad = at::logical_not(at::isfinite(t)).sum().item<int64_t>();
  TORCH_CHECK_VALUE(bad == 0, name, " contains ", bad, " NaN or infinite value(s) (check_finite=True)");
}

at::Tensor host_indices(const at::Tensor& idx) { return idx.to(at::kCPU).contiguous(); }

void check_index_range(const at::Tensor& host_idx, const char* name, int64_t bound) {
  const int64_t K = host_idx.size(1);
  const int64_t* p = host_idx.const_data_ptr<int64_t>();
  for (int64_t e = 0; e < host_idx.numel(); ++e) {
    TORCH_CHECK_INDEX(p[e] >= 0 && p[e] < bound, name, "[", e / K, ", ", e % K, "] = ", p[e],
                      " is out of range: expected 0 <= index < ", bound);
  }
}

}  // namespace ops
}  // namespace pullback
