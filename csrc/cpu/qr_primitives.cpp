// CPU backend of the CholeskyQR2 primitives: float64 Gram matrices and right multiplications.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <vector>

#include "cpu/qr_primitives.h"
#include "cpu/simd.h"

namespace pullback {
namespace cpu {

namespace {

constexpr int64_t kRowBlock = 4096;

// G[B,r,r] = Σ over row blocks of kernel(block) for X[B,P,r], where kernel(x, rows, G_partial,
// scratch) adds the block's contribution. Per-block partials are summed in a fixed order: the
// result does not depend on threading.
template <typename Kernel>
at::Tensor reduce_row_blocks(const at::Tensor& X, int64_t scratch_doubles, Kernel kernel) {
  const int64_t B = X.size(0), P = X.size(1), r = X.size(2);
  const int64_t nblk = (P + kRowBlock - 1) / kRowBlock;
  at::Tensor G = at::empty({B, r, r}, X.options().dtype(at::kDouble));
  std::vector<double> partial(B * nblk * r * r, 0.0);
  AT_DISPATCH_FLOATING_TYPES(X.scalar_type(), "gram_cpu", [&] {
    const scalar_t* x = X.const_data_ptr<scalar_t>();
    at::parallel_for(0, B * nblk, 1, [&](int64_t first, int64_t last) {
      std::vector<double> scratch(scratch_doubles);
      for (int64_t task = first; task < last; ++task) {
        const int64_t b = task / nblk, blk = task % nblk;
        const int64_t p0 = blk * kRowBlock, rows = std::min(kRowBlock, P - p0);
        kernel(b, x + (b * P + p0) * r, rows, partial.data() + task * r * r, scratch.data());
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

}  // namespace

at::Tensor gram(const at::Tensor& X) {
  const int64_t r = X.size(2);
  return reduce_row_blocks(X, PULLBACK_ROW_KERNEL(gram_scratch_doubles, r),
                           [&](int64_t, const auto* x, int64_t rows, double* G, double* scratch) {
                             PULLBACK_ROW_KERNEL(gram_rows, x, rows, r, G, scratch);
                           });
}

at::Tensor product_gram(const at::Tensor& X, const at::Tensor& M) {
  const int64_t r = X.size(2);
  const double* m = M.const_data_ptr<double>();
  return reduce_row_blocks(X, PULLBACK_ROW_KERNEL(product_gram_scratch_doubles, r),
                           [&](int64_t b, const auto* x, int64_t rows, double* G, double* scratch) {
                             PULLBACK_ROW_KERNEL(product_gram_rows, x, rows, r, m + b * r * r, G, scratch);
                           });
}

namespace {

// Y = (X M1) M2, or X M1 when m2 is null (M1, M2 as row-major [B,r,r] float64 on the host).
at::Tensor right_multiply_impl(const at::Tensor& X, const double* m1, const double* m2) {
  const int64_t B = X.size(0), P = X.size(1), r = X.size(2);
  const int64_t nblk = (P + kRowBlock - 1) / kRowBlock;
  at::Tensor Y = at::empty_like(X);
  AT_DISPATCH_FLOATING_TYPES(X.scalar_type(), "right_multiply_cpu", [&] {
    const scalar_t* x = X.const_data_ptr<scalar_t>();
    scalar_t* y = Y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, B * nblk, 1, [&](int64_t first, int64_t last) {
      std::vector<double> scratch(PULLBACK_ROW_KERNEL(right_multiply_scratch_doubles, r));
      for (int64_t task = first; task < last; ++task) {
        const int64_t b = task / nblk, blk = task % nblk;
        const int64_t p0 = blk * kRowBlock, rows = std::min(kRowBlock, P - p0);
        PULLBACK_ROW_KERNEL(right_multiply_rows, x + (b * P + p0) * r, rows, r, m1 + b * r * r,
                            m2 != nullptr ? m2 + b * r * r : nullptr, y + (b * P + p0) * r, scratch.data());
      }
    });
  });
  return Y;
}

}  // namespace

at::Tensor right_multiply(const at::Tensor& X, const at::Tensor& M) {
  return right_multiply_impl(X, M.const_data_ptr<double>(), nullptr);
}

at::Tensor right_multiply(const at::Tensor& X, const at::Tensor& M1, const at::Tensor& M2) {
  return right_multiply_impl(X, M1.const_data_ptr<double>(), M2.const_data_ptr<double>());
}

}  // namespace cpu
}  // namespace pullback
