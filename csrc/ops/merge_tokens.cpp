#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

#include "ops/checks.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace pullback {
namespace ops {

namespace {

// Within each image: src_idx has no repeated token and no dst_idx token is itself merged away.
void check_merge_sets(const at::Tensor& src, const at::Tensor& dst, int64_t N) {
  const int64_t B = src.size(0), R = src.size(1);
  const int64_t* s = src.const_data_ptr<int64_t>();
  const int64_t* d = dst.const_data_ptr<int64_t>();
  std::vector<int64_t> position(N);
  for (int64_t b = 0; b < B; ++b) {
    std::fill(position.begin(), position.end(), -1);
    for (int64_t i = 0; i < R; ++i) {
      const int64_t t = s[b * R + i];
      TORCH_CHECK_VALUE(position[t] < 0, "src_idx must not repeat a token within an image: src_idx[", b,
                        ", ", position[t], "] and src_idx[", b, ", ", i, "] are both ", t);
      position[t] = i;
    }
    for (int64_t i = 0; i < R; ++i) {
      const int64_t t = d[b * R + i];
      TORCH_CHECK_VALUE(position[t] < 0, "dst_idx must point at tokens that are kept: dst_idx[", b, ", ",
                        i, "] = ", t, " is also merged away (src_idx[", b, ", ", position[t], "])");
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> merge_tokens(const at::Tensor& x, const at::Tensor& w,
                                                const at::Tensor& src_idx, const at::Tensor& dst_idx,
                                                bool check_finite) {
  check_rank(x, "x", 3, "[B, N, D]");
  check_batch(x, "x");
  check_float_input(x, "x");
  const int64_t B = x.size(0), N = x.size(1);
  check_shape(w, "w", {B, N}, "[B, N]");
  check_same_device(w, "w", x, "x");
  check_same_dtype(w, "w", x, "x");
  check_index_tensor(src_idx, "src_idx", x, "x", B);
  const int64_t R = src_idx.size(1);
  check_index_tensor(dst_idx, "dst_idx", x, "x", B);
  check_shape(dst_idx, "dst_idx", {B, R}, "[B, R] (the shape of src_idx)");
  TORCH_CHECK_VALUE(R < N, "src_idx must merge fewer than N = ", N, " tokens per image, got R = ", R);
  if (value_checks(src_idx)) {
    const at::Tensor src = host_indices(src_idx), dst = host_indices(dst_idx);
    check_index_range(src, "src_idx", N);
    check_index_range(dst, "dst_idx", N);
    check_merge_sets(src, dst, N);
  }
  if (check_finite) {
    check_all_finite(x, "x");
    check_all_finite(w, "w");
  }
  check_nonnegative(w, "w");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const at::Tensor sc = src_idx.contiguous(), dc = dst_idx.contiguous();
  return PULLBACK_BACKEND_CALL(xc, merge_tokens, xc, wc, sc, dc);
}

}  // namespace ops
}  // namespace pullback
