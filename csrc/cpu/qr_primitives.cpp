// CPU backend of the CholeskyQR2 primitives: float64 Gram matrix and right multiplication.
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>

#include <vector>

#include "cpu/simd.h"
#include "kernels.h"

namespace pullback {
namespace cpu {

namespace {

constexpr int64_t kRowBlock = 4096;

}  // namespace

at::Tensor gram(const at::Tensor& X) {
  const int64_t B = X.size(0), P = X.size(1), r = X.size(2);
  const int64_t nblk = (P + kRowBlock - 1) / kRowBlock;
  at::Tensor G = at::empty({B, r, r}, X.options().dtype(at::kDouble));
  // Per-block partial Grams summed in a fixed order: the result does not depend on threading.
  std::vector<double> partial(B * nblk * r * r, 0.0);
  AT_DISPATCH_FLOATING_TYPES(X.scalar_type(), "gram_cpu", [&] {
    const scalar_t* x = X.const_data_ptr<scalar_t>();
    at::parallel_for(0, B * nblk, 1, [&](int64_t first, int64_t last) {
      std::vector<double> scratch(PULLBACK_ROW_KERNEL(gram_scratch_doubles, r));
      for (int64_t task = first; task < last; ++task) {
        const int64_t b = task / nblk, blk = task % nblk;
        const int64_t p0 = blk * kRowBlock, rows = std::min(kRowBlock, P - p0);
        PULLBACK_ROW_KERNEL(gram_rows, x + (b * P + p0) * r, rows, r,
                            partial.data() + task * r * r, scratch.data());
      }
    });
  });
  double* g = G.mutable_data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t e = 0; e < r * r; ++e) {
      double s = 0.0;
      for (int64_t blk = 0; blk < nblk; ++blk) s += partial[(b * nblk + blk) * r * r + e];
      g[b * r * r + e] = s;
    }
  }
  return G;
}

at::Tensor right_multiply(const at::Tensor& X, const at::Tensor& M) {
  const int64_t B = X.size(0), P = X.size(1), r = X.size(2);
  const int64_t nblk = (P + kRowBlock - 1) / kRowBlock;
  at::Tensor Y = at::empty_like(X);
  const double* m = M.const_data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES(X.scalar_type(), "right_multiply_cpu", [&] {
    const scalar_t* x = X.const_data_ptr<scalar_t>();
    scalar_t* y = Y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, B * nblk, 1, [&](int64_t first, int64_t last) {
      std::vector<double> scratch(PULLBACK_ROW_KERNEL(right_multiply_scratch_doubles, r));
      for (int64_t task = first; task < last; ++task) {
        const int64_t b = task / nblk, blk = task % nblk;
        const int64_t p0 = blk * kRowBlock, rows = std::min(kRowBlock, P - p0);
        PULLBACK_ROW_KERNEL(right_multiply_rows, x + (b * P + p0) * r, rows, r, m + b * r * r,
                            y + (b * P + p0) * r, scratch.data());
      }
    });
  });
  return Y;
}

}  // namespace cpu
}  // namespace pullback
